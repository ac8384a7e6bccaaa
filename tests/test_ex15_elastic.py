"""Exercise 15: verdicts from hand-made records, the grader's uninterrupted run, and (slow) that no
process outlives a grading that ran torchrun."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from grader import catalog
from grader.checks import ex15_elastic as ex
from grader.grading import Grading, Plan


def grading() -> Grading:
    return Grading(catalog.by_id("15"), "solutions/15_elastic.py", None, Plan("gloo", [4]))


def verdicts(g: Grading) -> dict:
    return {c.id: (c.status, c.message) for c in g.results(None) if c.status != "error"}


def load(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem.replace("15_", "ex15_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the statement and the grader agree ---------------------------------------------------


@pytest.mark.parametrize("relative", ["exercises/15_elastic.py", "solutions/15_elastic.py"])
def test_the_statement_s_constants_model_and_data_are_the_grader_s(relative):
    module = load(relative)
    for name in ("EPOCHS", "BATCH_SIZE", "NUM_SAMPLES", "LR", "MOMENTUM", "SEED"):
        assert getattr(module, name) == getattr(ex, name), name
    with torch.random.fork_rng():
        theirs, ours = module.build_model().state_dict(), ex.build_model().state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)
    for a, b in zip(module.build_dataset().tensors, ex.build_dataset().tensors):
        assert torch.equal(a, b)


def test_the_uninterrupted_run_is_what_ddp_with_sgd_momentum_computes():
    """Per step: the mean of every rank's mean loss, one torch.optim.SGD step with momentum."""
    from torch.utils.data import DistributedSampler

    world = 2
    with torch.random.fork_rng():
        model = ex.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=ex.LR, momentum=ex.MOMENTUM)
    dataset = ex.build_dataset()
    x, y = dataset.tensors
    for epoch in range(ex.EPOCHS):
        orders = []
        for rank in range(world):
            sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=ex.SEED)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for step in range(ex.NUM_SAMPLES // (world * ex.BATCH_SIZE)):
            optimizer.zero_grad()
            batch = slice(step * ex.BATCH_SIZE, (step + 1) * ex.BATCH_SIZE)
            loss = sum(torch.nn.functional.cross_entropy(model(x[o[batch]]), y[o[batch]]) for o in orders) / world
            loss.backward()
            optimizer.step()
    want = ex.uninterrupted(world)
    for name, value in model.state_dict().items():
        assert torch.allclose(value, want[name], atol=1e-6), name
    other = ex.uninterrupted(4)
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
    ex.check_shards(g, "2 nodes x 2", j)
    status, message = verdicts(g)["sampler-global-rank"]
    assert status == "fail" and "two nodes got the same shard" in message
    assert "RANK 2 (node b, LOCAL_RANK 0) gave its LOCAL_RANK where its RANK belongs" in message


def test_disjoint_shards_that_cover_the_data_pass(tmp_path):
    j = job(tmp_path, {f"{n}-0-{lr}": start(n, rank=2 * gr + lr, local_rank=lr, group_rank=gr)
                       + epoch(0, list(range(12 * (2 * gr + lr), 12 * (2 * gr + lr + 1))), sampler_rank=2 * gr + lr)
                       for gr, n in enumerate("ab") for lr in range(2)})
    g = grading()
    ex.check_shards(g, "2 nodes x 2", j)
    assert verdicts(g)["sampler-global-rank"][0] == "pass"


def test_every_epoch_drawn_at_sampler_epoch_0_fails_set_epoch(tmp_path):
    events = start() + epoch(0, list(range(12))) + epoch(0, list(range(12)))
    events = [e for e in events if e["e"] != "set_epoch"]
    j = job(tmp_path, {"a-0-0": events})
    g = grading()
    ex.check_set_epoch(g, "1 node x 4", j)
    status, message = verdicts(g)["set-epoch"]
    assert status == "fail" and "[0, 0]" in message and "never called" in message


def test_a_restart_that_never_loads_the_snapshot_fails(tmp_path):
    found = {"exists": True, "size": 100, "epoch": 1}
    j = job(tmp_path, {
        "a-0-0": start() + epoch(0, list(range(12))) + [{"e": "killed", "why": "mid-epoch", "steps": 8, "epoch": 2}],
        "a-1-0": start(attempt=1, found=found) + epoch(0, list(range(12))),
    }, plan={"rank": 0, "after_step": 8})
    g = grading()
    ex.check_resume(g, "2 nodes x 2", j)
    status, message = verdicts(g)["resumes-from-snapshot"]
    assert status == "fail" and "never loaded the snapshot (of epoch 1)" in message and "at epoch 2" in message


def test_a_torn_snapshot_after_the_kill_fails_atomic_and_names_os_replace(tmp_path):
    torn = {"exists": True, "size": 2502, "error": "RuntimeError: PytorchStreamReader failed. More words."}
    j = job(tmp_path, {
        "alone-0-0": start(node="alone") + [{"e": "killed", "why": "while writing the snapshot", "steps": 36,
                                             "epoch": 2}],
        "alone-1-0": start(node="alone", attempt=1, found=torn),
    }, world=1, plan=ex.ALONE_KILL)
    g = grading()
    ex.check_atomic(g, ex.ALONE, j)
    status, message = verdicts(g)["snapshot-atomic"]
    assert status == "fail" and "torn file" in message and "os.replace" in message and "More words" not in message


def test_a_kill_that_never_happened_says_why(tmp_path):
    j = job(tmp_path, {"alone-0-0": start(node="alone") + epoch(0, list(range(12)))}, world=1, plan=ex.ALONE_KILL)
    g = grading()
    ex.check_atomic(g, ex.ALONE, j)
    status, message = verdicts(g)["snapshot-atomic"]
    assert status == "fail" and "never happened" in message and "3 optimizer step(s)" in message


def test_a_snapshot_renamed_from_another_rank_s_file_fails_rank0_writes_only(tmp_path):
    path = os.path.abspath(os.path.join(str(tmp_path), "snapshot", ex.SNAPSHOT))
    tmp = path + ".2.tmp"
    j = job(tmp_path, {
        "a-0-0": start("a", rank=0) + [{"e": "write", "op": "torch.save", "path": path}],
        "b-0-0": start("b", rank=2, group_rank=1) + [{"e": "write", "op": "torch.save", "path": tmp},
                                                    {"e": "write", "op": "rename", "src": tmp, "path": path}],
    })
    g = grading()
    ex.check_writers(g, "2 nodes x 2", j)
    status, message = verdicts(g)["rank0-writes-only"]
    assert status == "fail" and "RANK 2 (node b" in message and "LOCAL_RANK 0 of another node" in message


def test_the_timeline_names_the_kill_the_restart_and_the_epoch_resumed_at(tmp_path):
    found = {"exists": True, "size": 100, "epoch": 1}
    j = job(tmp_path, {
        "b-0-1": start("b", rank=3, local_rank=1, group_rank=1) + epoch(0, list(range(3)))
        + [{"e": "killed", "why": "mid-epoch", "steps": 8, "epoch": 2}],
        "b-1-1": start("b", attempt=1, rank=3, local_rank=1, group_rank=1, found=found)
        + [{"e": "load", "path": "x", "epoch": 1}] + epoch(2, list(range(3))) + [{"e": "end", "steps": 3}],
    })
    j["agents"] = {"a": {"returncode": 0, "command": "torchrun ..."}, "b": {"returncode": 0, "command": "torchrun"}}
    entries = ex.timeline({"2 nodes x 2": j})
    workers = [e for e in entries if e["event"] == "worker"]
    assert workers[0]["ended"].startswith("killed by the grader mid-epoch")
    assert workers[1]["resumed_at"] == 2 and workers[1]["loaded_epoch"] == 1 and workers[1]["snapshot_found"] == 1
    assert "restarted, snapshot of epoch 1, loaded epoch 1; trained epochs [2]; finished" in workers[1]["text"]
    assert entries[-1]["event"] == "exit" and entries[-1]["codes"] == {"a": 0, "b": 0}


def test_gloo_s_long_peer_errors_become_one_phrase():
    text = "RuntimeError: [/__w/pytorch/third_party/gloo/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer."
    assert ex._short_error(text) == "lost a peer that died (Connection reset by peer)"
    assert ex._short_error("ValueError: [/x/y.cc:1] bad thing") == "ValueError: bad thing"


# --- nothing outlives a grading -----------------------------------------------------------------


CLI_ARGS = ("--format", "json", "--no-server")
CLI_TIMEOUT_S = catalog.by_id("15").timeout_s + 120


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
@pytest.mark.parametrize("path, code", [
    (ROOT / "solutions" / "15_elastic.py", 0),
    (ROOT / "tests" / "variants" / "15_overwrites_in_place.py", 1),
], ids=["passes", "fails"])
def test_no_agent_or_worker_outlives_a_grading_of_15(cli_grading, path, code):
    """Graded by the command, which has ended; the processes still carrying its tag are looked at then."""
    done = cli_grading(path, *CLI_ARGS, timeout_s=CLI_TIMEOUT_S)
    assert done["left"] == [], f"still alive after exit {done['returncode']}: {done['left']}"
    report = json.loads(done["stdout"])
    assert done["returncode"] == code, (report["problem"], [c for c in report["checks"] if c["status"] == "fail"])
    [timeline] = [s for s in report["sections"] if s["title"].startswith("timeline")]
    workers = [e for e in timeline["data"]["events"] if e["event"] == "worker"]
    assert {e["job"] for e in workers} == {ex.ALONE, *ex.JOBS}
    assert any(e["ended"].startswith("killed by the grader mid-epoch") for e in workers)


def test_with_nccl_a_worker_on_another_gpu_than_its_local_rank_fails(tmp_path):
    events = start("b", rank=2, local_rank=0, group_rank=1) + epoch(0, list(range(12)))
    for e in events:
        if e["e"] == "forward":
            e["device"] = "cuda:2"
    j = job(tmp_path, {"b-0-0": events})
    g = Grading(catalog.by_id("15"), "solutions/15_elastic.py", None, Plan("nccl", [4]))
    ex.check_devices(g, "2 nodes x 2", j)
    status, message = verdicts(g)["device-local-rank"]
    assert status == "fail" and "cuda:2" in message and "cuda:0, the GPU of its LOCAL_RANK" in message
    g = grading()
    ex.check_devices(g, "2 nodes x 2", j)
    assert {c.id: c.status for c in g.results(None)}["device-local-rank"] == "skip"


# --- waiting for the agents ---------------------------------------------------------------


def sleeping_agent(folder: Path, node: str) -> dict:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return {"job": "2 nodes x 2", "node": node, "folder": str(folder), "process": process}


def test_agents_of_a_job_whose_restart_is_used_and_whose_workers_ended_are_stopped_early(tmp_path, monkeypatch):
    """torchrun's exit barrier would keep them 300 s; the grader gives up LINGER_S after the last worker."""
    import time

    monkeypatch.setattr(ex, "LINGER_S", 0.5)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(ended.stdout)  # a worker process that has exited
    killed, restarted = start("a", attempt=0), start("a", attempt=1)
    killed[0]["pid"] = restarted[0]["pid"] = dead
    write_events(tmp_path, "a-0-0", killed + [{"e": "killed", "why": "mid-epoch"}])
    write_events(tmp_path, "a-1-0", restarted + epoch(2, list(range(12))))
    (tmp_path / "events" / ".start-a-0-1").touch()  # what a restarted worker leaves (ex._attempt)
    agents = [sleeping_agent(tmp_path, "a"), sleeping_agent(tmp_path, "b")]
    began = time.monotonic()
    try:
        ex._wait_for_agents(agents, time.monotonic() + 30)
    finally:
        for a in agents:
            a["process"].kill()
    assert time.monotonic() - began < 10
    assert all(a["returncode"] is None and a["lingered_s"] >= 0.5 for a in agents)


def test_agents_are_waited_for_while_no_restart_has_happened_or_a_worker_still_runs(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(ex, "LINGER_S", 0.1)
    first, second = tmp_path / "first", tmp_path / "second"
    write_events(first, "a-0-0", start("a", attempt=0) + epoch(0, list(range(12))))  # no restart yet
    running = start("a", attempt=1)
    running[0]["pid"] = os.getpid()  # this very process: alive
    write_events(second, "a-1-0", running)
    (second / "events" / ".start-a-0-1").touch()
    agents = [sleeping_agent(first, "a"), sleeping_agent(second, "a")]
    try:
        ex._wait_for_agents(agents, time.monotonic() + 2)
    finally:
        for a in agents:
            a["process"].kill()
    assert all(a["returncode"] is None and "lingered_s" not in a for a in agents)


def test_a_lingering_agent_fails_job_exits_0_and_says_why(tmp_path):
    j = job(tmp_path, {"a-0-0": start("a")})
    j["agents"] = {"a": {"returncode": None, "lingered_s": 20.3, "log": "RuntimeError: Connection reset by peer. x"},
                   "b": {"returncode": 0, "log": ""}}
    g = grading()
    ex.check_exit(g, "2 nodes x 2", j)
    status, message = verdicts(g)["job-exits-0"]
    assert status == "fail" and "node a had not exited 20 s after the job's last worker ended" in message
    assert "lost a peer that died" in message
