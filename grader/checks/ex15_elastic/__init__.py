"""Exercise 15: main() of a fault-tolerant training script, under a real torchrun.

The grader runs the learner's script as a user would, under ``python -m torch.distributed.run``,
twice at once, in one rank of its own (so its deadline and its killing of whole process groups
cover every agent and worker):

* "2 nodes x 2": two torchrun agents on this machine stand in for two nodes (``--nnodes 2
  --nproc-per-node 2 --rdzv-backend c10d --max-restarts 1``), joined at the rendezvous store the
  grader holds for the run (its port is never given up, so nothing else can take it). In the
  first attempt the worker with RANK 3 is killed (SIGKILL) in the middle of an epoch.
* "1 node x 4": one agent, ``--nnodes 1 --nproc-per-node 4``, the same script unchanged and
  uninterrupted.

Before them, in the warm pool, main() as the only worker ("1 worker, relaunched"): killed at the
moment its snapshot of epoch KILL_EPOCH reaches the path (half-way through writing the path itself,
or just before renaming a finished file onto it), then launched again from scratch on the same
folder with TORCHELASTIC_RESTART_COUNT=0, as a scheduler that requeues the job would.

No verdict depends on timing: the kills are placed by counting optimizer steps and file
operations, every restarted torchrun worker sees the same TORCHELASTIC_RESTART_COUNT (the
attempt's number; torchrun's own value on the node whose worker did not die depends on when its
agent noticed), and the relaunch runs one worker alone.

torchrun starts ``grader/rank/drivers/ex15_elastic.py`` in each worker (its ``torchrun_entry``): it
installs the probes, imports the learner's file and calls its ``main()``. The probes write what
they see to files at once, one JSON line per event, so that a worker killed without warning leaves
its record: the environment torchrun gave it, the snapshot as it found it, every sampler order,
every training batch and optimizer step, every file written near the snapshot, every torch.load,
the kill.

The grader reads those files, rebuilds the timeline (per node and rank: epochs, kill, restart,
epoch resumed from), trains the same model uninterrupted in its own process, and decides.

Here: ``grade``, the records read back and the timeline; ``rank.py``: the constants, model and data,
the grader's rank drivers ``alone_main`` and ``jobs_main`` (the agents' supervision), and what runs in
each worker; ``reference.py``: the uninterrupted run; ``verdicts.py``: the ``check_*`` functions.
"""

from __future__ import annotations

import fnmatch
import os

from grader.rank import untrusted, wire
from grader.rank.drivers.ex15_elastic import ALONE, ALONE_KILL, JOBS, KILL_EPOCH, WORLD_SIZE, alone_main, jobs_main
from grader.checks.ex15_elastic.reference import uninterrupted
from grader.checks.ex15_elastic.verdicts import (exit_text, short_error, snapshot_at, snapshot_words, who,
                                                 check_atomic, check_devices, check_exit, check_final, check_resume,
                                                 check_set_epoch, check_shards, check_snapshot, check_writers)


def grade(g) -> None:
    import uuid

    alone = run_alone(g)
    outcome = g.run(jobs_main, 1, kwargs={"tag": uuid.uuid4().hex},
                    label="torchrun: 2 nodes x 2 (a worker killed mid-epoch) and 1 node x 4", graded_size=WORLD_SIZE)
    info = outcome.results()[0]
    jobs = {ALONE: alone}
    for name, job in info["jobs"].items():
        jobs[name] = {**job, "workers": read_workers(job["folder"]), "world": WORLD_SIZE, "plan": JOBS[name]["kill"]}
    g.add_timeline(timeline(jobs))
    timed_out = [(name, node) for name, job in jobs.items() for node, a in job["agents"].items()
                 if a["returncode"] is None and a.get("lingered_s") is None]
    if timed_out:
        g.stop(_timeout_message(jobs, timed_out, info["timeout_s"]), status="timeout")
    references = {}
    for name, job in jobs.items():
        reference = references.setdefault(job["world"], uninterrupted(job["world"]))
        if job["agents"]:
            check_exit(g, name, job)
            check_devices(g, name, job)
        check_writers(g, name, job)
        check_shards(g, name, job)
        check_set_epoch(g, name, job)
        check_final(g, name, job, reference)
        check_snapshot(g, name, job)
    # torchrun's restart first: a relaunch that does not resume is then told whether the restart did
    restart_resumed = None
    for name, job in jobs.items():
        if job["plan"] and name != ALONE:
            restart_resumed = check_resume(g, name, job)
    check_resume(g, ALONE, alone, restart_resumed=restart_resumed)
    check_atomic(g, jobs)


def run_alone(g) -> dict:
    """main() as one worker, killed as its snapshot reaches the path, then the job launched again."""
    first = g.run(alone_main, 1, kwargs={"attempt": 0}, expect_ok=False, graded_size=1,
                  label=f"main() as one worker, killed as its snapshot of epoch {KILL_EPOCH} reaches the path")
    folder = os.path.join(first.run_dir, "alone")
    workers = read_workers(folder)
    if not any(w["killed"] for w in workers):
        g.stop_on_failures(first)  # the learner's own error (not implemented, an exception), with its line
    g.run(alone_main, 1, kwargs={"attempt": 1, "folder": folder}, expect_ok=False, graded_size=1,
          label="main() launched again from scratch on that snapshot (TORCHELASTIC_RESTART_COUNT=0)")
    return {"folder": folder, "workers": read_workers(folder), "agents": {}, "world": 1, "plan": ALONE_KILL}


def _timeout_message(jobs: dict, timed_out: list, timeout_s: float) -> str:
    lines = [f"torchrun had not finished after {timeout_s:.0f} s ("
             + ", ".join(f"{name}, node {node}" for name, node in timed_out) + "); the grader stopped it."]
    for name, node in timed_out:
        for w in jobs[name]["workers"]:
            if w["node"] == node and not w["finished"] and not w["killed"] and not w["error"]:
                lines.append(f"{name}: attempt {w['attempt']}, {who(w)} had trained epochs "
                             f"{[e['epoch'] for e in w['epochs']]} ({w['steps']} steps) and was still running")
    return "\n".join(lines)


def _read_lines(path: str, budget: wire.Budget) -> list[dict]:
    """The events of one worker; a line cut short by a kill is skipped."""
    try:
        events = untrusted.read_json_lines(path, budget)
    except untrusted.Unreadable:
        return []
    return [event for event in events if isinstance(event, dict) and isinstance(event.get("e"), str)]


def read_workers(folder: str) -> list[dict]:
    """Every worker start of one job, from its event file, summed up."""
    workers = []
    budget = wire.Budget()  # what the event files of one job may hold together
    try:
        found = untrusted.list_files(os.path.join(folder, "events"))
    except untrusted.Unreadable:
        found = []
    for path in (p for p in found if fnmatch.fnmatch(os.path.basename(p), "events-*.jsonl")):
        events = _read_lines(path, budget)
        start = next((e for e in events if e["e"] == "start"), None)
        if start is None:
            continue
        env = start.get("env") or {}
        name = os.path.basename(path)[len("events-"):-len(".jsonl")]
        worker = {
            "node": str(start.get("node")), "attempt": int(start.get("attempt", 0)), "pid": start.get("pid"),
            "rank": _int(env.get("RANK")), "local_rank": _int(env.get("LOCAL_RANK")),
            "world_size": _int(env.get("WORLD_SIZE")), "group_rank": _int(env.get("GROUP_RANK")),
            # what main() saw (the grader sets it), and what torchrun had set
            "restart_count": _int(start.get("restart_count", env.get("TORCHELASTIC_RESTART_COUNT"))),
            "torchrun_restart_count": _int(env.get("TORCHELASTIC_RESTART_COUNT")),
            "start": start["t"], "end": events[-1]["t"],
            "found": next((e for e in events if e["e"] == "snapshot-found"), {}),
            "loads": [e for e in events if e["e"] == "load"],
            "writes": [e for e in events if e["e"] == "write"],
            "set_epoch": [e.get("epoch") for e in events if e["e"] == "set_epoch"],
            "killed": next((e for e in events if e["e"] == "killed"), None),
            "error": next((e.get("error") for e in events if e["e"] == "error"), None),
            "finished": any(e["e"] == "end" for e in events),
            "steps": sum(1 for e in events if e["e"] == "step"),
            "devices": sorted({(e.get("device"), e.get("cuda_current")) for e in events if e["e"] == "forward"},
                              key=str),
            "final": os.path.join(folder, "events", f"final-{name}.pt"),
        }
        worker.update(_training(events))
        workers.append(worker)
    return workers


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _training(events: list[dict]) -> dict:
    """The batches that fed optimizer steps, grouped by the sampler iteration each came from.

    Returns ``epochs``: one entry per sampler iteration that fed a step, in order:
    ``{"epoch": sampler.epoch, "rank": ..., "num_replicas": ..., "indices": [...], "steps": n}``.
    """
    iterations: list[dict] = []
    epochs: list[dict] = []
    last_forward = None
    for e in events:
        if e["e"] == "iter":
            iterations.append(e)
        elif e["e"] == "forward":
            last_forward = (e.get("indices") or [], len(iterations) - 1)
        elif e["e"] == "step" and last_forward is not None:
            indices, index = last_forward
            last_forward = None
            if not epochs or epochs[-1]["iteration"] != index:
                source = iterations[index] if index >= 0 else {}
                epochs.append({"iteration": index, "epoch": source.get("epoch"), "rank": source.get("rank"),
                               "num_replicas": source.get("num_replicas"), "seed": source.get("seed"),
                               "shuffle": source.get("shuffle"), "indices": [], "steps": 0})
            epochs[-1]["indices"].extend(int(i) for i in indices)
            epochs[-1]["steps"] += 1
    return {"epochs": epochs}


def timeline(jobs: dict) -> list[dict]:
    """Per job, per node and rank, in order: start, snapshot found, epochs, the kill, the restart, the end."""
    out = []
    for name, job in jobs.items():
        workers = job["workers"]
        t0 = min((w["start"] for w in workers), default=0.0)
        if job["agents"]:
            command = next(iter(job["agents"].values()))["command"]
        else:
            command = (f"main() with RANK=0 WORLD_SIZE=1, killed as its snapshot of epoch {KILL_EPOCH} reaches the "
                       "path, then the job launched again from scratch on the same --snapshot "
                       "(TORCHELASTIC_RESTART_COUNT=0)")
        out.append({"job": name, "event": "command", "text": f"{name}: {command}"})
        for w in sorted(workers, key=lambda w: (w["attempt"], w["node"], w["rank"] is None, w["rank"] or 0)):
            out.append(_worker_entry(name, w, t0, os.path.abspath(snapshot_at(job))))
        if job["agents"]:
            codes = {node: a["returncode"] for node, a in sorted(job["agents"].items())}
            out.append({"job": name, "event": "exit", "codes": codes,
                        "text": f"{name}: torchrun exited with " + ", ".join(
                            f"node {n}: {exit_text(job['agents'][n])}" for n in codes)})
    return out


def _worker_entry(name: str, w: dict, t0: float, path: str | None = None) -> dict:
    found = w["found"]
    if not found.get("exists"):
        snapshot = None
    elif found.get("error"):
        snapshot = "unreadable"
    elif found.get("epoch") is None:
        snapshot = "no epoch"  # a snapshot that holds no integer "epoch" (the tutorial's EPOCHS_RUN, say)
    else:
        snapshot = found["epoch"]
    loads = [ld for ld in w["loads"] if not ld.get("error") and (path is None or ld.get("path") in (path, None))]
    loaded = loads[0].get("epoch") if loads else None
    epochs = [e["epoch"] for e in w["epochs"]]
    if w["killed"]:
        k = w["killed"]
        ended = f"killed by the grader {k.get('why')} (sampler epoch {k.get('epoch')}, after step {k.get('steps')})"
    elif w["finished"]:
        ended = "finished"
    elif w["error"]:
        ended = f"stopped: {short_error(w['error'])}"
    else:
        ended = "stopped by torchrun"
    entry = {
        "job": name, "event": "worker", "node": w["node"], "attempt": w["attempt"], "rank": w["rank"],
        "local_rank": w["local_rank"], "pid": w["pid"], "start_s": round(w["start"] - t0, 2),
        "end_s": round(w["end"] - t0, 2), "restart_count": w.get("restart_count"),
        "torchrun_restart_count": w.get("torchrun_restart_count"), "snapshot_found": snapshot,
        "loaded": bool(loads), "loaded_epoch": loaded, "epochs": epochs,
        "resumed_at": epochs[0] if w["attempt"] > 0 and epochs else None, "ended": ended,
    }
    if snapshot is None:
        found_text = "no snapshot"
    elif snapshot == "unreadable":
        found_text = "snapshot unreadable"
    elif snapshot == "no epoch":
        found_text = snapshot_words(found)[len("the "):]
    else:
        found_text = f"snapshot of epoch {snapshot}"
    loaded_text = "" if not loads else f", loaded epoch {loaded}" if loaded is not None else ", loaded it"
    if w["node"] == "alone":
        where, again = "", f"relaunched (TORCHELASTIC_RESTART_COUNT {w.get('restart_count')}), " if w["attempt"] else ""
    else:
        where, again = f"node {w['node']}, ", "restarted, " if w["attempt"] else ""
        if w.get("torchrun_restart_count") not in (None, w.get("restart_count")):
            again += (f"TORCHELASTIC_RESTART_COUNT set to {w.get('restart_count')} (this node's agent said "
                      f"{w.get('torchrun_restart_count')}), ")
    entry["text"] = (f"{name}, {where}attempt {w['attempt']}: RANK {w['rank']} (LOCAL_RANK {w['local_rank']}) "
                     f"{entry['start_s']:.1f}-{entry['end_s']:.1f} s: {again}{found_text}{loaded_text}; trained "
                     f"epochs {epochs or 'none'}; {ended}")
    return entry
