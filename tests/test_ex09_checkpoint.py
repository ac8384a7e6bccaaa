"""Exercise 09's verdicts and comparisons, from hand-made records (no processes started)."""

from __future__ import annotations

import torch

from grader.checks import ex09_checkpoint as ex
from grader.rank.drivers import ex09_checkpoint as ex_rank
from grading_helpers import grading_for, verdicts


grading = grading_for("09")


def save_record(returned: float, size: int | None, done=(), saves=(), error=None) -> dict:
    return {"returned": returned, "size_at_return": size, "write_done": list(done), "saves": list(saves),
            "save_error": error}


def test_a_rank_returning_before_the_write_ends_fails(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"x" * 100)
    g = grading()
    ex.check_barrier(g, [save_record(5.0, 100, done=[4.9]), save_record(4.4, None)], str(path), 2)
    status, message = verdicts(g)["barrier-after-save"]
    assert status == "fail" and "rank 1" in message and "500 ms" in message and "no file" in message


def test_every_rank_returning_after_the_write_passes(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"x" * 100)
    g = grading()
    ex.check_barrier(g, [save_record(5.0, 100, done=[4.9]), save_record(5.01, 100)], str(path), 2)
    assert verdicts(g)["barrier-after-save"][0] == "pass"


def writes(*records) -> dict:
    return {"writes": [dict(op=op, path=path, src=src, t=0.0) for op, path, src in records], "saves": []}


def test_a_write_of_the_checkpoint_by_another_rank_fails():
    g = grading()
    ex.check_writers(g, [writes(("torch.save", "/x/ckpt.pt", None)), writes(("torch.save", "/x/ckpt.pt", None))],
                     "/x/ckpt.pt", 2)
    status, message = verdicts(g)["rank0-writes-only"]
    assert status == "fail" and "rank 1 wrote the checkpoint (torch.save to ckpt.pt)" in message


def test_a_temporary_file_another_rank_renames_onto_the_checkpoint_counts_as_its_write():
    g = grading()
    ex.check_writers(g, [writes(("torch.save", "/x/ckpt.pt", None)),
                         writes(("open", "/x/tmp1", None), ("rename", "/x/ckpt.pt", "/x/tmp1"))], "/x/ckpt.pt", 2)
    status, message = verdicts(g)["rank0-writes-only"]
    assert status == "fail" and "renamed tmp1 onto ckpt.pt" in message


def test_rank0_writing_through_a_temporary_file_passes_and_other_files_do_not_count():
    g = grading()
    ex.check_writers(g, [writes(("open", "/x/.tmp0", None), ("rename", "/x/ckpt.pt", "/x/.tmp0")),
                         writes(("open", "/x/returned1", None))], "/x/ckpt.pt", 2)
    assert verdicts(g)["rank0-writes-only"][0] == "pass"


def test_state_difference_names_the_tensor_and_the_gap():
    a = {"w": torch.zeros(3), "b": torch.zeros(1)}
    assert ex._state_difference(dict(a), a) is None
    b = {"w": torch.tensor([0.0, 0.5, 0.0]), "b": torch.zeros(1)}
    assert "'w' differs by up to 0.5" in ex._state_difference(b, a)
    assert "missing ['b']" in ex._state_difference({"w": torch.zeros(3)}, a)


def test_optimizer_difference_sees_missing_state():
    model = ex_rank.build_model(0)
    opt = ex_rank.build_optimizer(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    full = opt.state_dict()
    assert ex._optimizer_difference(full, full) is None
    fresh = ex_rank.build_optimizer(ex_rank.build_model(0)).state_dict()
    assert "state for 0 parameter(s), expected state for 4" in ex._optimizer_difference(fresh, full)
