"""Exercise 33's model, data and verdicts, from hand-made records (no processes started).

Each verdict is shown passing on the record a right answer leaves and failing on a wrong one.
"""

from __future__ import annotations


import pytest
import torch

from grader.rank.drivers import ex33_dcp as rank_side
from grader.checks.ex33_dcp import reference as ref
from grader.checks.ex33_dcp import verdicts as v
from grader.compare import first_difference
from grading_helpers import grading_for, verdicts
from grader.rank.memory import tensor_bytes

SHAPES = ref.shapes()
LARGE = ref.large_parameters()
SAVE, LOAD = 2, 3


grading = grading_for("33", SAVE)


def _state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


STATES = {step: _state(step) for step in rank_side.RECORDED}
INITIAL = _state(0)
OPTIMIZER = {name: {"step": 3.0, "exp_avg": t * 0.1, "exp_avg_sq": t * t * 0.01} for name, t in _state(77).items()}
EXPECTED = {"params": STATES, "optimizer": OPTIMIZER}


def _shard(state: dict, rank: int, world_size: int) -> dict:
    return {name: torch.tensor_split(t, world_size)[rank].clone() for name, t in state.items()}


def _optimizer_shard(state: dict, rank: int, world_size: int) -> dict:
    return {name: {key: torch.tensor_split(value, world_size)[rank].clone() if isinstance(value, torch.Tensor)
                   else value for key, value in entry.items()} for name, entry in state.items()}


# --- a save job's records ----------------------------------------------------------------------------------

FOLDER = "/run/resume"


def _save(folder: str, step: int, called: float, returned: float, threads: list[int], started: float) -> dict:
    return {"folder": folder, "step": step, "called": called, "returned": returned, "error": None,
            "next_step_started": started, "threads": threads}


def _write(op: str, path: str, t: float, thread: int, **more) -> dict:
    return {"op": op, "path": path, "folder": rank_side.RESUME, "t": t, "thread": thread, "main": thread == 0, **more}


def _collective(op: str, t: float, thread: int, t_end: float | None = None, training: bool = False) -> dict:
    return {"op": op, "t": t, "t_end": t + 0.01 if t_end is None else t_end, "thread": thread, "main": thread == 0,
            "training_group": training, "refused": False}


def _background_save(rank: int, thread: int, start: float, folder: str) -> tuple[list, list]:
    """An async save's thread: planning collectives, its file held by the slow disk, the metadata, the finish."""
    writes = [_write("open", f"{folder}/__{rank}_0.distcp", start + 0.02, thread),
              _write("held", f"{folder}/__{rank}_0.distcp", start + 0.27, thread)]
    if rank == 0:
        writes += [_write("open", f"{folder}/.metadata.tmp", start + 0.28, thread),
                   _write("rename", f"{folder}/.metadata", start + 0.29, thread, src=f"{folder}/.metadata.tmp")]
    collectives = [_collective("gather_object", start, thread), _collective("scatter_object_list", start + 0.01, thread),
                   _collective("gather_object", start + 0.29, thread), _collective("broadcast_object_list", start + 0.3,
                                                                                    thread)]
    return writes, collectives


def save_record(rank: int, world_size: int = SAVE) -> dict:
    """What a right answer's rank records: async saves after steps 9 and 10, the second waiting for the first."""
    first, second = f"{FOLDER}/step-00000009", f"{FOLDER}/step-00000010"
    w1, c1 = _background_save(rank, 1, 1.01, first)
    w2, c2 = _background_save(rank, 2, 1.42, second)  # after the first one's last collective (1.31 + 0.01)
    return {"saves": [_save(rank_side.RESUME, 9, 1.0, 1.005, [1], 1.006), _save(rank_side.RESUME, 10, 1.1, 1.41, [2], 1.411)],
            "writes": w1 + w2, "collectives": c1 + c2, "memory": [],
            "params": {step: _shard(state, rank, world_size) for step, state in STATES.items()},
            "optimizer": _optimizer_shard(OPTIMIZER, rank, world_size)}


def records(world_size: int = SAVE) -> list[dict]:
    return [save_record(rank, world_size) for rank in range(world_size)]


def files_of(recs: list[dict], step: int = 10) -> dict:
    """Each rank's data file of the newest save holding its shards, as DCP writes them (with other bytes)."""
    return {f"{FOLDER}/step-{step:08d}/__{rank}_0.distcp":
            b"PK".join(tensor_bytes(t) for t in recs[rank]["params"][step].values()) for rank in range(len(recs))}


def test_a_step_is_the_same_global_batch_on_any_number_of_ranks():
    whole = rank_side.batch(9, 0, 1)
    for world_size in (2, 3, 4):
        parts = [rank_side.batch(9, r, world_size) for r in range(world_size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    assert not torch.equal(rank_side.batch(10, 0, 1)[0], whole[0])


def test_the_large_parameters_are_the_matrices_and_their_shards_are_distinct():
    assert set(LARGE) == {n for n, shape in SHAPES.items() if len(shape) == 2}
    recs = records()
    for name in LARGE:
        assert tensor_bytes(recs[0]["params"][10][name]) != tensor_bytes(recs[1]["params"][10][name])


def test_assemble_puts_dim0_shards_together_and_takes_a_whole_tensor_once():
    state = STATES[10]
    assert first_difference(v.assemble([_shard(state, r, 3) for r in range(3)], SHAPES), state) is None
    assert first_difference(v.assemble([state, state], SHAPES), state) is None
    assert v.assemble([_shard(state, 0, 2), {}], SHAPES) == {}


# --- the group, async, waiting ---------------------------------------------------------------------------


def test_background_collectives_on_a_group_of_their_own_pass():
    g = grading()
    assert v.check_own_group(g, records(), SAVE)
    assert verdicts(g)["own-group"][0] == "pass"


def test_a_refused_collective_on_the_training_group_fails_own_group_and_names_the_save():
    recs = records()
    recs[1]["collectives"][0].update(training_group=True, refused=True)
    g = grading()
    assert not v.check_own_group(g, recs, SAVE)
    status, message = verdicts(g)["own-group"]
    assert status == "fail" and "rank 1" in message and "step=9" in message and "new_group" in message


def test_async_save_refused_on_an_nccl_default_group_fails_own_group():
    recs = records()
    recs[0]["saves"][0]["error"] = "AssertionError: A CPU backend must be enabled for async save; try ..."
    g = grading()
    assert not v.check_own_group(g, recs, SAVE)
    assert "gloo group of its own" in verdicts(g)["own-group"][1]


def test_a_save_that_returns_before_its_files_are_written_passes_async():
    g = grading()
    v.check_async(g, records(), SAVE)
    assert verdicts(g)["async-save"][0] == "pass"


def test_a_blocking_save_fails_async_and_says_how_long_it_took():
    recs = records()
    for r, record in enumerate(recs):
        record["saves"][0]["returned"] = 1.35  # after the metadata's rename at 1.30
        record["saves"][0]["next_step_started"] = 1.36
    g = grading()
    v.check_async(g, recs, SAVE)
    status, message = verdicts(g)["async-save"]
    assert status == "fail" and "rank 0" in message and "returned 0.35 s after" in message


def test_a_save_that_writes_nothing_fails_async():
    recs = records()
    for record in recs:
        record["writes"] = [w for w in record["writes"] if "step-00000009" not in w["path"]]
        record["collectives"] = [c for c in record["collectives"] if c["thread"] != 1]
    g = grading()
    v.check_async(g, recs, SAVE)
    assert "wrote no file" in verdicts(g)["async-save"][1]


def test_one_save_in_flight_at_a_time_passes_waits_previous():
    g = grading()
    v.check_waits(g, records(), SAVE)
    assert verdicts(g)["waits-previous"][0] == "pass"


def test_a_second_save_planning_while_the_first_is_held_fails_waits_previous():
    recs = records()
    for record in recs:
        record["saves"][1]["returned"] = 1.12
        for event in record["writes"] + record["collectives"]:
            if event["thread"] == 2:  # the second save's thread, started at once
                event["t"] -= 0.29
                if event.get("t_end"):
                    event["t_end"] -= 0.29
    g = grading()
    v.check_waits(g, recs, SAVE)
    status, message = verdicts(g)["waits-previous"]
    assert status == "fail" and "step=10) began" in message and "step=9) was still running" in message


def test_a_rename_by_the_previous_saves_thread_after_its_last_collective_passes_waits_previous():
    recs = records()
    for record in recs:  # the rename a done-callback makes while the next save plans
        record["writes"].append(_write("rename", f"{FOLDER}/step-9", 1.43, 1, src=f"{FOLDER}/.tmp-step-9"))
    g = grading()
    v.check_waits(g, recs, SAVE)
    assert verdicts(g)["waits-previous"][0] == "pass"


def test_events_go_to_the_save_that_started_their_thread_or_ran_them():
    record = save_record(0)
    record["writes"].append(_write("open", f"{FOLDER}/x", 1.05, 0))  # the main thread, outside any save
    record["writes"].append(_write("open", f"{FOLDER}/y", 1.2, 0))  # the main thread, during the second save
    record["writes"].append(_write("open", f"{FOLDER}/z", 1.5, 9))  # a thread no save started: the latest save
    first, second = v.activity(record)
    assert {e["path"] for e in second if e["kind"] == "write"} >= {f"{FOLDER}/y", f"{FOLDER}/z"}
    assert f"{FOLDER}/x" not in {e.get("path") for e in first + second}
    assert all(e["thread"] == 1 for e in first)


# --- the files and the memory ------------------------------------------------------------------------


def test_every_rank_writing_its_own_shards_passes():
    recs = records()
    g = grading()
    v.check_own_shards(g, recs, files_of(recs), SAVE, LARGE)
    assert verdicts(g)["own-shards"][0] == "pass"


def test_a_rank_that_writes_nothing_fails_own_shards():
    recs = records()
    recs[1]["writes"] = [w for w in recs[1]["writes"] if "step-00000010" not in w["path"]]
    g = grading()
    v.check_own_shards(g, recs, files_of(recs), SAVE, LARGE)
    status, message = verdicts(g)["own-shards"]
    assert status == "fail" and message.startswith("rank 1 wrote no file")


def test_shards_gathered_into_rank0s_file_fail_own_shards():
    recs = records()
    files = files_of(recs)
    files[f"{FOLDER}/step-00000010/__0_0.distcp"] = b"".join(tensor_bytes(t) for t in STATES[10].values())
    del files[f"{FOLDER}/step-00000010/__1_0.distcp"]
    g = grading()
    v.check_own_shards(g, recs, files, SAVE, LARGE)
    status, message = verdicts(g)["own-shards"]
    assert status == "fail" and "rank 0 wrote rank 1's shard" in message and "gathered" in message


def test_a_rank_writing_another_ranks_shard_too_fails_own_shards():
    recs = records()
    files = files_of(recs)
    files[f"{FOLDER}/step-00000010/__0_0.distcp"] += files[f"{FOLDER}/step-00000010/__1_0.distcp"]
    g = grading()
    v.check_own_shards(g, recs, files, SAVE, LARGE)
    assert "rank 0 also wrote rank 1's shard" in verdicts(g)["own-shards"][1]


def test_files_in_a_folder_renamed_later_are_read_where_they_ended_up():
    recs = records()
    for record in recs:
        for w in record["writes"]:
            w["path"] = w["path"].replace("step-00000010", ".tmp-10")
        record["writes"].append(_write("rename", f"{FOLDER}/step-00000010", 1.8, 2, src=f"{FOLDER}/.tmp-10"))
    assert f"{FOLDER}/step-00000010/__1_0.distcp" in v.written_files(recs, 1)[1]
    assert not any(".tmp-10" in path for path in v.written_files(recs, 1)[1])
    g = grading()
    v.check_own_shards(g, recs, files_of(recs), SAVE, LARGE)
    assert verdicts(g)["own-shards"][0] == "pass"


def test_no_whole_parameter_in_memory_passes_and_one_fails_with_its_name_and_shape():
    g = grading()
    v.check_memory(g, [], SHAPES, [2, 3])
    assert verdicts(g)["whole-model"][0] == "pass"
    held = {"call": "load(path, model, optimizer) of the resume folder", "where": "after torch.load",
            "names": ["blocks.0.up.weight", "head.weight"], "rank": 2, "world_size": 3}
    g = grading()
    v.check_memory(g, [held], SHAPES, [2, 3])
    status, message = verdicts(g)["whole-model"]
    assert status == "fail" and "rank 2 of 3 held the whole of 'blocks.0.up.weight' (96x48) and 1 more" in message


def test_a_rank_alone_holding_the_whole_model_is_its_shard_not_a_failure():
    """--world-size 1 saves on one rank and loads on two: the save's one rank holds every parameter whole, as its
    shard; the loads' ranks still must not. With no world of two ranks or more the check cannot be decided."""
    alone = {"call": "save(path, model, optimizer, step=9)", "where": "as it returned", "names": ["head.weight"],
             "rank": 0, "world_size": 1}
    g = grading()
    v.check_memory(g, [alone], SHAPES, [1, 2])
    assert verdicts(g)["whole-model"][0] == "pass"
    g = grading()
    v.check_memory(g, [alone, dict(alone, rank=1, world_size=2)], SHAPES, [1, 2])
    assert verdicts(g)["whole-model"][0] == "fail"
    g = grading()
    v.check_memory(g, [alone], SHAPES, [1])
    assert verdicts(g)["whole-model"][0] == "skip"


# --- the loads ---------------------------------------------------------------------------------------


def loads(world_size: int = LOAD, resume: dict | None = None, kill: dict | None = None) -> list[dict]:
    """Every rank's record of a right load: the checkpoint of step 10 resumed to 12, the kill folder's of 12."""
    resume = STATES[10] if resume is None else resume
    kill = STATES[12] if kill is None else kill
    return [{rank_side.RESUME: {"returned": 10, "error": None, "params": _shard(resume, r, world_size),
                        "optimizer": _optimizer_shard(OPTIMIZER, r, world_size),
                        "final": _shard(STATES[12], r, world_size)},
             rank_side.KILL: {"returned": 12, "error": None, "params": _shard(kill, r, world_size),
                      "optimizer": _optimizer_shard(OPTIMIZER, r, world_size)},
             "memory": []} for r in range(world_size)]


def load_verdicts(recs: list[dict], world_size: int = LOAD, notes=None) -> dict:
    g = grading(world_size)
    v.check_returns_step(g, recs, 10, world_size)
    v.check_resume(g, recs, EXPECTED, INITIAL, SHAPES, 10, 12, SAVE, world_size)
    v.check_optimizer(g, recs, EXPECTED, SHAPES, 10, world_size)
    v.check_kill(g, recs, EXPECTED, INITIAL, notes or {0: "/run/kill/step-13/__0_0.distcp"}, 12, world_size)
    return verdicts(g)


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_right_load_passes_every_load_check(world_size):
    got = load_verdicts(loads(world_size), world_size)
    assert {k: s for k, (s, _) in got.items()} == {"returns-step": "pass", "resharded-resume": "pass",
                                                  "optimizer-state": "pass", "survives-kill": "pass"}


@pytest.mark.parametrize("returned", [9, True, "10", 10.0, None])
def test_any_other_step_fails_returns_step(returned):
    recs = loads()
    recs[1][rank_side.RESUME]["returned"] = returned
    status, message = load_verdicts(recs)["returns-step"]
    assert status == "fail" and "rank 1 of 3" in message and repr(returned) in message


def test_an_older_checkpoint_fails_resume_and_says_which():
    status, message = load_verdicts(loads(resume=STATES[9]))["resharded-resume"]
    assert status == "fail" and "after step 9: an older checkpoint" in message


def test_later_parameters_in_the_checkpoint_fail_resume_and_blame_the_missing_staging():
    status, message = load_verdicts(loads(resume=STATES[12]))["resharded-resume"]
    assert status == "fail" and "after step 12" in message and "stages" in message


def test_a_load_that_restores_nothing_fails_resume():
    status, message = load_verdicts(loads(resume=INITIAL))["resharded-resume"]
    assert status == "fail" and "restored nothing" in message


def test_steps_after_the_load_off_by_more_than_rounding_fail_resume():
    recs = loads()
    recs[0][rank_side.RESUME]["final"]["head.weight"] += 1e-3
    status, message = load_verdicts(recs)["resharded-resume"]
    assert status == "fail" and "'head.weight' differs by up to 0.001" in message
    recs = loads()
    recs[0][rank_side.RESUME]["final"]["head.weight"] += 1e-7
    assert load_verdicts(recs)["resharded-resume"][0] == "pass"


def test_a_load_that_raises_fails_resume_and_leaves_the_optimizer_undecided():
    recs = loads()
    recs[2][rank_side.RESUME] = {"returned": None, "error": "RuntimeError: mixed torch.Tensor and DTensor"}
    got = load_verdicts(recs)
    assert got["resharded-resume"][0] == "fail" and "rank 2 of 3" in got["resharded-resume"][1]
    assert got["optimizer-state"][0] == "not-checked"


def test_a_fresh_optimizer_fails_optimizer_state():
    recs = loads()
    for record in recs:
        record[rank_side.RESUME]["optimizer"] = {}
    status, message = load_verdicts(recs)["optimizer-state"]
    assert status == "fail" and "fresh AdamW" in message


def test_another_step_count_or_average_fails_optimizer_state():
    recs = loads()
    for record in recs:
        record[rank_side.RESUME]["optimizer"]["embed.weight"]["step"] = 0.0
    assert "step for 'embed.weight' is 0.0" in load_verdicts(recs)["optimizer-state"][1]
    recs = loads()
    recs[1][rank_side.RESUME]["optimizer"]["head.bias"]["exp_avg"] += 0.5
    assert "'head.bias' is not the checkpoint's" in load_verdicts(recs)["optimizer-state"][1]


def test_after_a_kill_a_load_that_raises_or_takes_the_killed_save_fails():
    recs = loads()
    recs[0][rank_side.KILL] = {"returned": None, "error": "CheckpointException (ranks [0, 1, 2]); ..."}
    status, message = load_verdicts(recs)["survives-kill"]
    assert status == "fail" and "rank 0 as it opened __0_0.distcp" in message and "CheckpointException" in message
    recs = loads()
    recs[2][rank_side.KILL]["returned"] = 13
    assert "returned 13, the killed save's step" in load_verdicts(recs)["survives-kill"][1]


def test_after_a_kill_a_model_holding_something_else_fails():
    status, message = load_verdicts(loads(kill=STATES[10]))["survives-kill"]
    assert status == "fail" and "after step 10: an older checkpoint" in message
