"""Exercise 29's verdicts from hand-made records, and the replay of a job resumed on another number of
ranks (no processes started)."""

from __future__ import annotations

import torch

from grader.checks import ex29_reshard_resume as ex
from grader.checks.shared import fsdp_job
from grader.compare import largest_difference


def test_every_rank_writing_its_part_passes(tmp_path):
    records = [{"written": ["__0_0.distcp", ".metadata"]}, {"written": ["__1_0.distcp"]}]
    assert ex.own_files_verdict(records, str(tmp_path)) == (True, "")


def test_one_rank_writing_for_all_fails_naming_the_silent_ranks(tmp_path):
    records = [{"written": ["full.pt"]}, {"written": []}, {"written": []}]
    ok, message = ex.own_files_verdict(records, str(tmp_path))
    assert not ok and message.startswith("ranks 1 and 2 wrote no file") and "rank 0: full.pt" in message


def test_no_checkpoint_folder_fails(tmp_path):
    ok, message = ex.own_files_verdict([{"written": []}], str(tmp_path / "missing"))
    assert not ok and "no checkpoint was saved" in message


def test_a_resume_on_as_many_ranks_replays_as_the_job_that_never_stopped():
    """Two phases on 2 ranks, the momentum carried, are the uninterrupted run: the replay's phases join."""
    data = ex.make_data()
    whole = fsdp_job.replayed(data, [(2, range(ex.EPOCHS))])
    split = fsdp_job.replayed(data, [(2, range(ex.FIRST_EPOCHS)), (2, range(ex.FIRST_EPOCHS, ex.EPOCHS))])
    assert largest_difference(whole, split) is None or largest_difference(whole, split).max_abs == 0


def test_a_resume_on_3_ranks_differs_from_one_on_2_and_from_a_fresh_start():
    """Else the resumed-on-3 check could not tell a job that started over, or used the wrong batches."""
    data = ex.make_data()
    resumed = fsdp_job.replayed(data, [(2, range(ex.FIRST_EPOCHS)), (3, range(ex.FIRST_EPOCHS, ex.EPOCHS))])
    assert fsdp_job.replay_difference(resumed, data, [(3, range(ex.FIRST_EPOCHS, ex.EPOCHS))]) is not None
    assert fsdp_job.replay_difference(resumed, data, [(3, range(ex.EPOCHS))]) is not None
    assert fsdp_job.replay_difference(
        resumed, data, [(2, range(ex.FIRST_EPOCHS)), (3, range(ex.FIRST_EPOCHS, ex.EPOCHS))]) is None
    nudged = {k: v + 1e-3 if k == "output.bias" else v for k, v in resumed.items()}
    found = fsdp_job.replay_difference(nudged, data, [(2, range(ex.FIRST_EPOCHS)), (3, range(ex.FIRST_EPOCHS, ex.EPOCHS))])
    assert found is not None and "output.bias" in str(found)


def test_the_saved_model_is_read_back_or_refused_with_a_reason(tmp_path):
    (tmp_path / "out").mkdir()
    assert fsdp_job.saved_model(str(tmp_path))[1].startswith("rank 0 saved no model.pt")
    torch.save({"w": torch.zeros(1)}, tmp_path / "out" / "model.pt")
    saved, why = fsdp_job.saved_model(str(tmp_path))
    assert saved is None and "is not the script's model" in why
    torch.save(fsdp_job.build_model().state_dict(), tmp_path / "out" / "model.pt")
    saved, why = fsdp_job.saved_model(str(tmp_path))
    assert why == "" and set(saved) == set(fsdp_job.build_model().state_dict())


def _shard(rank: int, name: str = "w") -> bytes:
    return torch.full((128,), float(10 * rank + len(name)), dtype=torch.float32).numpy().tobytes()


def test_files_holding_only_their_own_shards_pass_and_the_whole_tensor_in_each_file_fails():
    prints = [{"tok_embeddings.weight": _shard(r)} for r in range(2)]
    right = [{"files": {f"__{r}_0.distcp": b"head" + _shard(r) + b"tail"}, "prints": prints[r]} for r in range(2)]
    assert ex.own_shards_verdict(right) == (True, "")
    # full_tensor() on every rank, then torch.save into rank{r}.pt: each file holds both shards.
    whole = _shard(0) + _shard(1)
    wrong = [{"files": {f"rank{r}.pt": b"head" + whole}, "prints": prints[r]} for r in range(2)]
    ok, message = ex.own_shards_verdict(wrong)
    assert not ok and "rank 1's files (rank1.pt) hold rank 0's shard of 'tok_embeddings.weight'" in message
    missing = [{"files": {"__0_0.distcp": b""}, "prints": prints[0]}, right[1]]
    ok, message = ex.own_shards_verdict(missing)
    assert not ok and "rank 0's shard of 'tok_embeddings.weight' is in none of the files rank 0 wrote" in message
    ok, message = ex.own_shards_verdict([{"files": {"a": b"x"}, "prints": {}}, {"files": {}, "prints": {}}])
    assert not ok and "no sharded parameter was found" in message


def test_a_whole_parameter_held_while_writing_fails_and_names_the_file_and_line():
    assert ex.whole_model_verdict([{"whole": []}, {"whole": []}]) == (True, "")
    records = [{"whole": [{"file": "rank0.pt", "where": "line 72, in save_checkpoint",
                           "names": ["tok_embeddings.weight", "tok_embeddings.weight (its momentum)"]}]}, {"whole": []}]
    ok, message = ex.whole_model_verdict(records)
    assert not ok and "rank 0 held the whole of tok_embeddings.weight and 1 more as it wrote rank0.pt" in message
    assert "(line 72, in save_checkpoint)" in message
    # What a rank sent is validated: anything but a list of entries with names is left out.
    assert ex.whole_model_verdict([{"whole": "everything"}, {"whole": [{"names": "x"}]}]) == (True, "")
