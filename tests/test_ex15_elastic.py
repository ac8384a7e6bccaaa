"""Exercise 15: verdicts from hand-made records, the grader's uninterrupted run, why no verdict
depends on timing, and (slow) that no process outlives a grading that ran torchrun."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import background
from conftest import ROOT
from grader import catalog
from grader.checks import ex15_elastic as ex
from grader.rank.drivers import ex15_elastic as rank_side
from grader.checks.ex15_elastic import reference as ref
from grader.checks.ex15_elastic import verdicts as v
from grader.grading import Grading, Plan
from grading_helpers import grading_for, verdicts


grading = grading_for("15", 4)


def load(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem.replace("15_", "ex15_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the statement and the grader agree ---------------------------------------------------


@pytest.mark.parametrize("relative", ["exercises/15_elastic.py", "solutions/15_elastic.py"])
def test_the_statement_s_constants_and_data_are_the_grader_s(relative):
    """(The model: tests/test_stub_models.py.)"""
    module = load(relative)
    for name in ("EPOCHS", "BATCH_SIZE", "NUM_SAMPLES", "LR", "MOMENTUM", "SEED"):
        assert getattr(module, name) == getattr(rank_side, name), name
    for a, b in zip(module.build_dataset().tensors, rank_side.build_dataset().tensors):
        assert torch.equal(a, b)


def test_the_uninterrupted_run_is_what_ddp_with_sgd_momentum_computes():
    """Per step: the mean of every rank's mean loss, one torch.optim.SGD step with momentum."""
    from torch.utils.data import DistributedSampler

    world = 2
    with torch.random.fork_rng():
        model = rank_side.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=rank_side.LR, momentum=rank_side.MOMENTUM)
    dataset = rank_side.build_dataset()
    x, y = dataset.tensors
    for epoch in range(rank_side.EPOCHS):
        orders = []
        for rank in range(world):
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=rank_side.SEED)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for step in range(rank_side.NUM_SAMPLES // (world * rank_side.BATCH_SIZE)):
            optimizer.zero_grad()
            batch = slice(step * rank_side.BATCH_SIZE, (step + 1) * rank_side.BATCH_SIZE)
            loss = sum(torch.nn.functional.cross_entropy(model(x[o[batch]]), y[o[batch]]) for o in orders) / world
            loss.backward()
            optimizer.step()
    want = ref.uninterrupted(world)
    for name, value in model.state_dict().items():
        assert torch.allclose(value, want[name], atol=1e-6), name
    other = ref.uninterrupted(4)
    assert any(not torch.allclose(other[k], want[k]) for k in want), "the world size changes the run"


# --- records read back ----------------------------------------------------------------------


def write_events(folder: Path, name: str, events: list[dict]) -> None:
    (folder / "events").mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({**e, "t": float(i)}) for i, e in enumerate(events)]
    (folder / "events" / f"events-{name}.jsonl").write_text("\n".join(lines) + "\n{\"e\": \"step\", \"cut sh")


def start(node="a", attempt=0, rank=0, local_rank=0, group_rank=0, found=None) -> list[dict]:
    env = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "4", "GROUP_RANK": str(group_rank),
           "TORCHELASTIC_RESTART_COUNT": "0"}
    return [{"e": "start", "pid": 100 + rank, "node": node, "attempt": attempt, "env": env},
            {"e": "snapshot-found", **(found or {"exists": False})}]


def epoch(number: int, indices: list[int], sampler_rank: int = 0, steps: int = 3) -> list[dict]:
    out = [{"e": "set_epoch", "epoch": number},
           {"e": "iter", "epoch": number, "rank": sampler_rank, "num_replicas": 4, "shuffle": True, "seed": 15,
            "order": indices}]
    per = max(1, len(indices) // steps)
    for s in range(steps):
        out += [{"e": "forward", "indices": indices[s * per:(s + 1) * per], "device": "cpu", "cuda_current": None},
                {"e": "step", "n": s + 1}]
    return out


def test_a_cut_last_line_is_skipped_and_batches_are_grouped_by_sampler_iteration(tmp_path):
    write_events(tmp_path, "a-0-0", start() + epoch(0, list(range(12))) + epoch(1, list(range(12, 24)))
                 + [{"e": "killed", "why": "mid-epoch", "steps": 6, "epoch": 1}])
    [w] = ex.read_workers(str(tmp_path))
    assert [e["epoch"] for e in w["epochs"]] == [0, 1]
    assert w["epochs"][1]["indices"] == list(range(12, 24)) and w["epochs"][1]["steps"] == 3
    assert w["killed"]["why"] == "mid-epoch" and w["steps"] == 6


def job(tmp_path, workers: dict[str, list[dict]], world=4, plan=None) -> dict:
    for name, events in workers.items():
        write_events(tmp_path, name, events)
    return {"folder": str(tmp_path), "workers": ex.read_workers(str(tmp_path)), "agents": {}, "world": world,
            "plan": plan or {}}


def test_two_nodes_reading_one_shard_are_named_with_the_local_rank_mistake(tmp_path):
    shard = list(range(12))
    j = job(tmp_path, {
        "a-0-0": start("a", rank=0, local_rank=0) + epoch(0, shard, sampler_rank=0),
        "b-0-0": start("b", rank=2, local_rank=0, group_rank=1) + epoch(0, shard, sampler_rank=0),
    })
    g = grading()
    v.check_shards(g, "2 nodes x 2", j)
    status, message = verdicts(g)["sampler-global-rank"]
    assert status == "fail" and "two nodes got the same shard" in message
    assert "RANK 2 (node b, LOCAL_RANK 0) gave its LOCAL_RANK where its RANK belongs" in message


def test_disjoint_shards_that_cover_the_data_pass(tmp_path):
    j = job(tmp_path, {f"{n}-0-{lr}": start(n, rank=2 * gr + lr, local_rank=lr, group_rank=gr)
                       + epoch(0, list(range(12 * (2 * gr + lr), 12 * (2 * gr + lr + 1))), sampler_rank=2 * gr + lr)
                       for gr, n in enumerate("ab") for lr in range(2)})
    g = grading()
    v.check_shards(g, "2 nodes x 2", j)
    assert verdicts(g)["sampler-global-rank"][0] == "pass"


def test_every_epoch_drawn_at_sampler_epoch_0_fails_set_epoch(tmp_path):
    events = start() + epoch(0, list(range(12))) + epoch(0, list(range(12)))
    events = [e for e in events if e["e"] != "set_epoch"]
    j = job(tmp_path, {"a-0-0": events})
    g = grading()
    v.check_set_epoch(g, "1 node x 4", j)
    status, message = verdicts(g)["set-epoch"]
    assert status == "fail" and "[0, 0]" in message and "never called" in message


def test_a_restart_that_never_loads_the_snapshot_fails(tmp_path):
    found = {"exists": True, "size": 100, "epoch": 1}
    j = job(tmp_path, {
        "a-0-0": start() + epoch(0, list(range(12))) + [{"e": "killed", "why": "mid-epoch", "steps": 8, "epoch": 2}],
        "a-1-0": start(attempt=1, found=found) + epoch(0, list(range(12))),
    }, plan={"rank": 0, "after_step": 8})
    g = grading()
    v.check_resume(g, "2 nodes x 2", j)
    status, message = verdicts(g)["resumes-from-snapshot"]
    assert status == "fail" and "never loaded the snapshot of epoch 1" in message and "at epoch 2" in message


def test_a_torn_snapshot_after_the_kill_fails_atomic_and_names_os_replace(tmp_path):
    torn = {"exists": True, "size": 2502, "error": "RuntimeError: PytorchStreamReader failed. More words."}
    j = job(tmp_path, {
        "alone-0-0": start(node="alone") + [{"e": "write", "op": "torch.save", "path": snapshot_path(tmp_path),
                                              "line": 91, "code": "torch.save(snapshot, args.snapshot)"},
                                             {"e": "killed", "why": rank_side.KILLED_WRITING, "steps": 36, "epoch": 2,
                                              "op": "torch.save"}],
        "alone-1-0": start(node="alone", attempt=1, found=torn),
    }, world=1, plan=rank_side.ALONE_KILL)
    g = grading()
    v.check_atomic(g, {rank_side.ALONE: j})
    status, message = verdicts(g)["snapshot-atomic"]
    assert status == "fail" and "torn file" in message and "os.replace" in message and "More words" not in message
    assert "line 91: torch.save(snapshot, args.snapshot)" in message


def test_a_kill_that_never_happened_says_why(tmp_path):
    j = job(tmp_path, {"alone-0-0": start(node="alone") + epoch(0, list(range(12)))}, world=1, plan=rank_side.ALONE_KILL)
    g = grading()
    v.check_atomic(g, {rank_side.ALONE: j})
    status, message = verdicts(g)["snapshot-atomic"]
    assert status == "fail" and "never happened" in message and "3 optimizer step(s)" in message
    assert "neither wrote snapshot.pt" in message


def snapshot_path(folder) -> str:
    return os.path.abspath(os.path.join(str(folder), "snapshot", rank_side.SNAPSHOT))


def killed_and_relaunched(folder: Path, why: str, found: dict, writes: list[dict] = (),
                          relaunched: list[dict] = ()) -> dict:
    """The single-worker run: attempt 0 killed as its snapshot of epoch 2 reached the path, attempt 1
    relaunched with TORCHELASTIC_RESTART_COUNT=0 onto what it found, then ``relaunched``'s events."""
    again = start(node="alone", attempt=1, found=found)
    again[0]["restart_count"] = "0"
    return job(folder, {
        "alone-0-0": start(node="alone") + list(writes) + [{"e": "killed", "why": why, "steps": 36, "epoch": 2}],
        "alone-1-0": again + list(relaunched),
    }, world=1, plan=rank_side.ALONE_KILL)


def test_a_copy_onto_the_path_is_torn_by_the_kill_and_named(tmp_path):
    """shutil.copyfile(tmp, path): the kill lands on the open of the path itself, not on the temporary file."""
    tmp, path = snapshot_path(tmp_path) + ".tmp", snapshot_path(tmp_path)
    writes = [{"e": "write", "op": "torch.save", "path": tmp},
              {"e": "write", "op": "open", "path": path, "line": 92, "code": "shutil.copyfile(tmp_path, args.snapshot)"}]
    j = killed_and_relaunched(tmp_path, rank_side.KILLED_WRITING, {"exists": True, "size": 0, "error": "EOFError (no message)"},
                              writes)
    j["workers"][0]["killed"]["op"] = "open"
    g = grading()
    v.check_atomic(g, {rank_side.ALONE: j})
    status, message = verdicts(g)["snapshot-atomic"]
    assert status == "fail" and "opened snapshot.pt for writing, line 92: shutil.copyfile" in message
    assert "torn file at the path (0 bytes" in message and "shutil.copyfile does, writes the path in place" in message


def test_a_direct_write_fails_atomic_even_where_no_kill_tore_it(tmp_path):
    """The kill found the previous snapshot whole, but a worker of a torchrun job wrote the path itself."""
    alone = killed_and_relaunched(tmp_path / "alone", rank_side.KILLED_BEFORE_RENAME, {"exists": True, "size": 99, "epoch": 1})
    path = snapshot_path(tmp_path / "job")
    torchrun = job(tmp_path / "job", {"a-0-0": start("a", rank=0) + [
        {"e": "write", "op": "open", "path": path, "line": 88, "code": "with open(args.snapshot, 'r+b') as f:"}]})
    g = grading()
    v.check_atomic(g, {rank_side.ALONE: alone, "2 nodes x 2": torchrun})
    status, message = verdicts(g)["snapshot-atomic"]
    assert status == "fail" and message.startswith("2 nodes x 2: attempt 0: RANK 0 (node a, LOCAL_RANK 0) wrote")
    assert "line 88: with open(args.snapshot, 'r+b') as f:" in message and "os.replace" in message


def test_a_rename_onto_the_path_after_the_old_snapshot_was_removed_leaves_nothing(tmp_path):
    """os.remove(path), then os.replace(tmp, path), each epoch: the kill before the rename finds nothing there."""
    tmp = snapshot_path(tmp_path) + ".tmp"
    writes = [{"e": "write", "op": "rename", "src": tmp, "path": snapshot_path(tmp_path)}] * 3  # epochs 0, 1, 2
    j = killed_and_relaunched(tmp_path, rank_side.KILLED_BEFORE_RENAME, {"exists": False}, writes)
    g = grading()
    v.check_atomic(g, {rank_side.ALONE: j})
    status, message = verdicts(g)["snapshot-atomic"]
    assert status == "fail" and "found no snapshot at all" in message and "removed or renamed away" in message
    j = killed_and_relaunched(tmp_path / "first", rank_side.KILLED_BEFORE_RENAME, {"exists": False}, writes[:1])
    g = grading()
    v.check_atomic(g, {rank_side.ALONE: j})
    status, message = verdicts(g)["snapshot-atomic"]
    assert status == "fail" and "the first time anything reached snapshot.pt" in message


def test_a_kill_before_the_rename_that_leaves_the_previous_snapshot_passes(tmp_path):
    tmp = snapshot_path(tmp_path) + ".tmp"
    writes = [{"e": "write", "op": "torch.save", "path": tmp},
              {"e": "write", "op": "rename", "src": tmp, "path": snapshot_path(tmp_path)}]
    j = killed_and_relaunched(tmp_path, rank_side.KILLED_BEFORE_RENAME, {"exists": True, "size": 99, "epoch": 1}, writes)
    g = grading()
    v.check_atomic(g, {rank_side.ALONE: j})
    assert verdicts(g)["snapshot-atomic"][0] == "pass"


def test_a_relaunch_onto_the_snapshot_that_does_not_resume_names_the_restart_count(tmp_path):
    """The job launched again (TORCHELASTIC_RESTART_COUNT=0) trains from scratch, while torchrun's restart resumed."""
    j = killed_and_relaunched(tmp_path, rank_side.KILLED_BEFORE_RENAME, {"exists": True, "size": 99, "epoch": 1},
                              relaunched=epoch(0, list(range(12))) + epoch(1, list(range(12))))
    g = grading()
    assert v.check_resume(g, rank_side.ALONE, j, restart_resumed=True) is False
    status, message = verdicts(g)["resumes-from-snapshot"]
    assert status == "fail" and "launched again from scratch onto the snapshot of epoch 1" in message
    assert "TORCHELASTIC_RESTART_COUNT=0" in message and "whatever the restart count says" in message


def test_a_worker_that_started_over_beside_one_that_resumed_is_not_blamed_on_the_samplers(tmp_path):
    """Right samplers (rank 0 and rank 1 of 4), one worker at epoch 2 after loading, the other at epoch 0:
    the samples overlap, but the cause is the resume, and resumes-from-snapshot names it."""
    found = {"exists": True, "size": 99, "epoch": 1}
    from torch.utils.data import DistributedSampler

    def order(rank, at):
        sampler = DistributedSampler(rank_side.build_dataset(), num_replicas=4, rank=rank, shuffle=True, seed=rank_side.SEED)
        sampler.set_epoch(at)
        return list(sampler)

    resumed = start("a", attempt=1, rank=0, local_rank=0, found=found) + [
        {"e": "load", "path": snapshot_path(tmp_path), "epoch": 1}] + epoch(2, order(0, 2), 0) + epoch(3, order(0, 3), 0)
    over = start("a", attempt=1, rank=1, local_rank=1, found=found) + epoch(0, order(1, 0), 1) + epoch(1, order(1, 1), 1)
    assert set(order(0, 2)) & set(order(1, 0)), "the two shards share samples"
    j = job(tmp_path, {"a-0-0": start("a") + [{"e": "killed", "why": rank_side.KILLED_MID_EPOCH, "steps": 8, "epoch": 2}],
                       "a-1-0": resumed, "a-1-1": over}, plan={"rank": 0, "after_step": 8})
    g = grading()
    v.check_shards(g, "2 nodes x 2", j)
    v.check_resume(g, "2 nodes x 2", j)
    got = verdicts(g)
    assert got["sampler-global-rank"][0] == "pass"
    status, message = got["resumes-from-snapshot"]
    assert status == "fail" and "RANK 1 (node a, LOCAL_RANK 1) never loaded the snapshot of epoch 1" in message
    assert "while RANK 0 (node a, LOCAL_RANK 0) loaded it and began with epoch 2" in message


def test_resuming_is_judged_at_the_start_not_by_a_later_failure(tmp_path):
    """A worker that loaded and began at the epoch after the snapshot resumed, even if a peer's crash stopped
    it later (when that came is timing); one that loaded and then raised before training did not."""
    found = {"exists": True, "size": 99, "epoch": 1}
    load = [{"e": "load", "path": snapshot_path(tmp_path), "epoch": 1}]
    killed = start("a") + [{"e": "killed", "why": rank_side.KILLED_MID_EPOCH, "steps": 8, "epoch": 2}]
    stopped = start("a", attempt=1, found=found) + load + epoch(2, list(range(12))) + [
        {"e": "error", "error": "RuntimeError: [/x/pair.cc:1] Connection closed by peer"}]
    j = job(tmp_path, {"a-0-0": killed, "a-1-0": stopped}, plan={"rank": 0, "after_step": 8})
    g = grading()
    assert v.check_resume(g, "2 nodes x 2", j) is True
    raised = start("a", attempt=1, found=found) + load + [
        {"e": "error", "error": "RuntimeError: Error(s) in loading state_dict for DistributedDataParallel: x"}]
    j = job(tmp_path, {"a-0-0": killed, "a-1-0": raised}, plan={"rank": 0, "after_step": 8})
    g = grading()
    assert v.check_resume(g, "2 nodes x 2", j) is False
    message = verdicts(g)["resumes-from-snapshot"][1]
    assert "loaded the snapshot of epoch 1 but trained no epoch after it: main() ended with RuntimeError: " \
        "Error(s) in loading state_dict for DistributedDataParallel" in message


def test_workers_at_one_epoch_with_different_seeds_are_told_so(tmp_path):
    shard = list(range(12))
    j = job(tmp_path, {
        "a-0-0": start("a", rank=0, local_rank=0) + epoch(0, shard, sampler_rank=0),
        "a-0-1": start("a", rank=1, local_rank=1) + epoch(0, shard, sampler_rank=1),
    })
    for event in j["workers"][1]["epochs"]:
        event["seed"] = 16
    g = grading()
    v.check_shards(g, "1 node x 4", j)
    status, message = verdicts(g)["sampler-global-rank"]
    assert status == "fail" and "seed=15 and seed=16" in message and "same seed" in message


def test_a_snapshot_renamed_from_another_rank_s_file_fails_rank0_writes_only(tmp_path):
    path = os.path.abspath(os.path.join(str(tmp_path), "snapshot", rank_side.SNAPSHOT))
    tmp = path + ".2.tmp"
    j = job(tmp_path, {
        "a-0-0": start("a", rank=0) + [{"e": "write", "op": "torch.save", "path": path}],
        "b-0-0": start("b", rank=2, group_rank=1) + [{"e": "write", "op": "torch.save", "path": tmp},
                                                    {"e": "write", "op": "rename", "src": tmp, "path": path}],
    })
    g = grading()
    v.check_writers(g, "2 nodes x 2", j)
    status, message = verdicts(g)["rank0-writes-only"]
    assert status == "fail" and "RANK 2 (node b" in message and "LOCAL_RANK 0 of another node" in message


def test_the_timeline_names_the_kill_the_restart_and_the_epoch_resumed_at(tmp_path):
    found = {"exists": True, "size": 100, "epoch": 1}
    j = job(tmp_path, {
        "b-0-1": start("b", rank=3, local_rank=1, group_rank=1) + epoch(0, list(range(3)))
        + [{"e": "killed", "why": "mid-epoch", "steps": 8, "epoch": 2}],
        "b-1-1": start("b", attempt=1, rank=3, local_rank=1, group_rank=1, found=found)
        + [{"e": "load", "path": snapshot_path(tmp_path), "epoch": 1}] + epoch(2, list(range(3)))
        + [{"e": "end", "steps": 3}],
    })
    j["agents"] = {"a": {"returncode": 0, "command": "torchrun ..."}, "b": {"returncode": 0, "command": "torchrun"}}
    entries = ex.timeline({"2 nodes x 2": j})
    workers = [e for e in entries if e["event"] == "worker"]
    assert workers[0]["ended"].startswith("killed by the grader mid-epoch")
    assert workers[1]["resumed_at"] == 2 and workers[1]["loaded_epoch"] == 1 and workers[1]["snapshot_found"] == 1
    assert "restarted, snapshot of epoch 1, loaded epoch 1; trained epochs [2]; finished" in workers[1]["text"]
    assert entries[-1]["event"] == "exit" and entries[-1]["codes"] == {"a": 0, "b": 0}


def test_the_timeline_names_a_snapshot_that_holds_no_integer_epoch(tmp_path):
    """The torchrun tutorial's snapshot ({"MODEL_STATE": ..., "EPOCHS_RUN": n}): found and loaded, not "no snapshot"."""
    found = {"exists": True, "size": 100, "epoch": None, "keys": ["EPOCHS_RUN", "MODEL_STATE"], "type": "dict"}
    j = job(tmp_path, {
        "a-1-0": start("a", attempt=1, found=found)
        + [{"e": "load", "path": snapshot_path(tmp_path), "epoch": None, "keys": ["EPOCHS_RUN", "MODEL_STATE"]}]
        + epoch(2, list(range(3))) + [{"e": "end", "steps": 3}],
    })
    [worker] = [e for e in ex.timeline({"2 nodes x 2": j}) if e["event"] == "worker"]
    assert worker["snapshot_found"] == "no epoch" and worker["loaded"] is True and worker["loaded_epoch"] is None
    assert "no snapshot" not in worker["text"]
    assert ("restarted, snapshot (it holds no integer 'epoch'; its keys: EPOCHS_RUN, MODEL_STATE), loaded it; "
            "trained epochs [2]") in worker["text"]


def test_gloo_s_long_peer_errors_become_one_phrase():
    text = "RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer."
    assert v.short_error(text) == "lost a peer that died (Connection reset by peer)"
    assert v.short_error("ValueError: [/x/y.cc:1] bad thing") == "ValueError: bad thing"


# --- no verdict depends on timing ---------------------------------------------------------------
#
# Grading every variant of 15 twice would double the suite's most expensive jobs, so these tests
# pin down why a grading cannot come out differently the next time:
# 1. Where the kills land is counted, never timed: the 2 nodes x 2 kill after an optimizer step of
#    RANK 3, the single worker's at the first write onto (or rename onto) the snapshot path after a
#    step. A step of DDP is an all-reduce of every worker, so at the 2 nodes x 2 kill (a step into
#    epoch KILL_EPOCH) rank 0 has finished its save of epoch KILL_EPOCH - 1, whoever is faster.
# 2. What main() reads from its environment is the same every time: torchrun's agent on the node
#    whose worker did not die sets TORCHELASTIC_RESTART_COUNT to 0 or 1 depending on when it noticed
#    the failure, so the grader's entry sets the attempt's number on every worker (below); the
#    relaunch, one worker alone, has 0.
# 3. The records are read by what happened, not when: attempts from start markers made with
#    O_EXCL per node and local rank, epochs from sampler iterations, never from timestamps
#    (below: the same records with other times give the same verdicts).
# 4. An agent that does not exit is stopped LINGER_S after the job's last worker ended and fails
#    job-exits-0 as a non-zero exit does (test_a_lingering_agent_fails_job_exits_0_and_says_why).


def test_the_kills_are_placed_by_counting_steps_and_writes_never_by_time():
    plans = [job["kill"] for job in rank_side.JOBS.values()] + [rank_side.ALONE_KILL]
    assert all(set(plan) <= {"rank", "after_step", "write_after_step"} for plan in plans)
    mid_epoch = rank_side.JOBS["2 nodes x 2"]["kill"]["after_step"]
    assert rank_side.KILL_EPOCH * rank_side.STEPS_PER_EPOCH < mid_epoch < (rank_side.KILL_EPOCH + 1) * rank_side.STEPS_PER_EPOCH
    assert rank_side.ALONE_KILL["write_after_step"] == (rank_side.KILL_EPOCH + 1) * rank_side.ALONE_STEPS_PER_EPOCH


def test_every_restarted_worker_sees_the_attempt_as_its_restart_count_whatever_its_agent_said(tmp_path):
    """As torchrun starts it on the node whose agent did not count the restart (it says 0)."""
    learner = tmp_path / "15_learner.py"
    seen = tmp_path / "seen.txt"
    learner.write_text("import os\n\ndef main():\n"
                       f"    open({str(seen)!r}, 'w').write(os.environ['TORCHELASTIC_RESTART_COUNT'])\n")
    events = tmp_path / "events"
    events.mkdir()
    (events / ".start-a-0-0").touch()  # attempt 0 of this node's LOCAL_RANK 0 started before
    env = {**os.environ, rank_side.ENV_EVENTS: str(events), rank_side.ENV_NODE: "a", "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "4", "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, rank_side.ENTRY_SCRIPT, str(learner), "--snapshot", str(tmp_path / "s" / "x.pt")],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert seen.read_text() == "1"
    [worker] = ex.read_workers(str(tmp_path))
    assert (worker["attempt"], worker["restart_count"], worker["torchrun_restart_count"]) == (1, 1, 0)
    entry = ex.timeline({"2 nodes x 2": {**job(tmp_path, {}), "workers": [worker]}})[1]
    assert "TORCHELASTIC_RESTART_COUNT set to 1 (this node's agent said 0)" in entry["text"]


def test_the_same_records_with_other_times_give_the_same_verdicts(tmp_path):
    found = {"exists": True, "size": 99, "epoch": 1}
    workers = {}
    for gr, node in enumerate("ab"):
        for lr in range(2):
            rank = 2 * gr + lr
            shard = list(range(12 * rank, 12 * (rank + 1)))
            workers[f"{node}-0-{lr}"] = start(node, rank=rank, local_rank=lr, group_rank=gr) + epoch(0, shard, rank)
            workers[f"{node}-1-{lr}"] = (start(node, attempt=1, rank=rank, local_rank=lr, group_rank=gr, found=found)
                                         + [{"e": "load", "path": snapshot_path(tmp_path / "x"), "epoch": 1}]
                                         + epoch(2, shard, rank) + epoch(3, shard[::-1], rank))
    workers["b-0-1"].append({"e": "killed", "why": rank_side.KILLED_MID_EPOCH, "steps": 8, "epoch": 2})

    def decided(folder: Path, times) -> dict:
        for name, events in workers.items():
            write_events(folder, name, events)
            path = folder / "events" / f"events-{name}.jsonl"
            lines = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
            path.write_text("".join(json.dumps({**e, "t": times(i)}) + "\n" for i, e in enumerate(lines)))
        j = {"folder": str(folder), "workers": ex.read_workers(str(folder)), "agents": {}, "world": 4,
             "plan": rank_side.JOBS["2 nodes x 2"]["kill"]}
        g = grading()
        for check in (v.check_resume, v.check_shards, v.check_set_epoch, v.check_writers):
            check(g, "2 nodes x 2", j)
        return verdicts(g)

    first = decided(tmp_path / "x", float)
    assert {check: status for check, (status, _) in first.items()} == {
        "resumes-from-snapshot": "pass", "sampler-global-rank": "pass", "set-epoch": "pass",
        "rank0-writes-only": "fail"}  # nobody wrote the snapshot in these records
    assert decided(tmp_path / "x", lambda i: 1000.0 - 7 * i) == first


# --- nothing outlives a grading -----------------------------------------------------------------


CLI_ARGS = ("--format", "json", "--no-server")
CLI_TIMEOUT_S = catalog.by_id("15").timeout_s + 120


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
@pytest.mark.parametrize("path, code", [
    pytest.param(path, code, id=name, marks=background.command(path, CLI_ARGS, CLI_TIMEOUT_S))
    for path, code, name in ((ROOT / "solutions" / "15_elastic.py", 0, "passes"),
                             (ROOT / "tests" / "variants" / "15_overwrites_in_place.py", 1, "fails"))])
def test_no_agent_or_worker_outlives_a_grading_of_15(cli_grading, path, code):
    """Graded by the command, which has ended; the processes still carrying its tag are looked at then."""
    done = cli_grading(path, *CLI_ARGS, timeout_s=CLI_TIMEOUT_S)
    assert done["left"] == [], f"still alive after exit {done['returncode']}: {done['left']}"
    report = json.loads(done["stdout"])
    assert done["returncode"] == code, (report["problem"], [c for c in report["checks"] if c["status"] == "fail"])
    [timeline] = [s for s in report["sections"] if s["title"].startswith("timeline")]
    workers = [e for e in timeline["data"]["events"] if e["event"] == "worker"]
    assert {e["job"] for e in workers} == {rank_side.ALONE, *rank_side.JOBS}
    assert any(e["ended"].startswith("killed by the grader mid-epoch") for e in workers)


def test_with_nccl_a_worker_on_another_gpu_than_its_local_rank_fails(tmp_path):
    events = start("b", rank=2, local_rank=0, group_rank=1) + epoch(0, list(range(12)))
    for e in events:
        if e["e"] == "forward":
            e["device"] = "cuda:2"
    j = job(tmp_path, {"b-0-0": events})
    g = Grading(catalog.by_id("15"), "solutions/15_elastic.py", None, Plan("nccl", [4]))
    v.check_devices(g, "2 nodes x 2", j)
    status, message = verdicts(g)["device-local-rank"]
    assert status == "fail" and "cuda:2" in message and "cuda:0, the GPU of its LOCAL_RANK" in message
    g = grading()
    v.check_devices(g, "2 nodes x 2", j)
    assert {c.id: c.status for c in g.results(None)}["device-local-rank"] == "skip"


# --- waiting for the agents ---------------------------------------------------------------


def sleeping_agent(folder: Path, node: str) -> dict:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return {"job": "2 nodes x 2", "node": node, "folder": str(folder), "process": process}


def test_agents_of_a_job_whose_restart_is_used_and_whose_workers_ended_are_stopped_early(tmp_path, monkeypatch):
    """torchrun's exit barrier would keep them 300 s; the grader gives up LINGER_S after the last worker."""
    import time

    monkeypatch.setattr(rank_side, "LINGER_S", 0.5)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(ended.stdout)  # a worker process that has exited
    killed, restarted = start("a", attempt=0), start("a", attempt=1)
    killed[0]["pid"] = restarted[0]["pid"] = dead
    write_events(tmp_path, "a-0-0", killed + [{"e": "killed", "why": "mid-epoch"}])
    write_events(tmp_path, "a-1-0", restarted + epoch(2, list(range(12))))
    (tmp_path / "events" / ".start-a-0-1").touch()  # what a restarted worker leaves (rank_side._attempt)
    agents = [sleeping_agent(tmp_path, "a"), sleeping_agent(tmp_path, "b")]
    try:
        # A deadline no test run reaches: the wait must end because every worker is done and the
        # agents only linger, not because time ran out (the agents are still alive when it returns).
        rank_side._wait_for_agents(agents, time.monotonic() + 3600)
        still_alive = [a["process"].poll() is None for a in agents]
    finally:
        for a in agents:
            a["process"].kill()
    assert still_alive == [True, True]
    assert all(a["returncode"] is None and a["lingered_s"] >= 0.5 for a in agents)


def test_agents_are_waited_for_while_no_restart_has_happened_or_a_worker_still_runs(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(rank_side, "LINGER_S", 0.1)
    first, second = tmp_path / "first", tmp_path / "second"
    write_events(first, "a-0-0", start("a", attempt=0) + epoch(0, list(range(12))))  # no restart yet
    running = start("a", attempt=1)
    running[0]["pid"] = os.getpid()  # this very process: alive
    write_events(second, "a-1-0", running)
    (second / "events" / ".start-a-0-1").touch()
    agents = [sleeping_agent(first, "a"), sleeping_agent(second, "a")]
    try:
        rank_side._wait_for_agents(agents, time.monotonic() + 2)
    finally:
        for a in agents:
            a["process"].kill()
    assert all(a["returncode"] is None and "lingered_s" not in a for a in agents)


def test_a_lingering_agent_fails_job_exits_0_and_says_why(tmp_path):
    j = job(tmp_path, {"a-0-0": start("a")})
    j["agents"] = {"a": {"returncode": None, "lingered_s": 20.3, "log": "RuntimeError: Connection reset by peer. x"},
                   "b": {"returncode": 0, "log": ""}}
    g = grading()
    v.check_exit(g, "2 nodes x 2", j)
    status, message = verdicts(g)["job-exits-0"]
    assert status == "fail" and "node a had not exited 20 s after the job's last worker ended" in message
    assert "lost a peer that died" in message


def test_a_temporary_file_renamed_from_another_folder_fails_with_exdev_named(tmp_path):
    """tempfile.mkstemp() then os.replace onto the path: fine on one disk, EXDEV on a cluster's shared storage."""
    elsewhere = os.path.join(str(tmp_path / "system-tmp"), "tmpab12cd.pt")
    writes = [{"e": "write", "op": "rename", "src": elsewhere, "path": snapshot_path(tmp_path), "line": 96,
               "code": "os.replace(tmp_path, args.snapshot)"}]
    j = killed_and_relaunched(tmp_path, rank_side.KILLED_BEFORE_RENAME, {"exists": True, "size": 99, "epoch": 1}, writes)
    g = grading()
    v.check_atomic(g, {rank_side.ALONE: j})
    status, message = verdicts(g)["snapshot-atomic"]
    assert status == "fail" and f"renamed {elsewhere} onto snapshot.pt (line 96" in message
    assert "EXDEV" in message and "beside the snapshot" in message
    assert v.same_folder(snapshot_path(tmp_path) + ".tmp", snapshot_path(tmp_path))
    assert not v.same_folder(elsewhere, snapshot_path(tmp_path))
