"""Exercise 15, the grader's reading: every worker's record read back, the uninterrupted run the final
weights are compared with, the timeline of each job, and the words for what they hold (see
:mod:`grader.checks.ex15_elastic` for the whole exercise and the verdicts).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re

import torch
from torch import nn

from grader import untrusted
from grader.checks.ex15_worker import (BATCH_SIZE, EPOCHS, KILL_EPOCH, LR, MOMENTUM, NUM_SAMPLES, SEED, SNAPSHOT,
                                       build_dataset, build_model)


# --- in the grader: read the records --------------------------------------------------------


def _read_lines(path: str) -> list[dict]:
    """The events of one worker; a line cut short by a kill is skipped."""
    out = []
    try:
        lines = untrusted.read_text(path).splitlines()
    except untrusted.Unreadable:
        return out
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("e"), str):
            out.append(event)
    return out


def read_workers(folder: str) -> list[dict]:
    """Every worker start of one job, from its event file, summed up."""
    workers = []
    try:
        found = untrusted.list_files(os.path.join(folder, "events"))
    except untrusted.Unreadable:
        found = []
    for path in (p for p in found if fnmatch.fnmatch(os.path.basename(p), "events-*.jsonl")):
        events = _read_lines(path)
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


def _who(w: dict) -> str:
    if w["node"] == "alone":
        return f"RANK {w['rank']} (the only worker)"
    return f"RANK {w['rank']} (node {w['node']}, LOCAL_RANK {w['local_rank']})"


def _read_final(path: str) -> dict | None:
    try:
        state = untrusted.load_tensors(path)
    except untrusted.Unreadable:
        return None
    return state if isinstance(state, dict) else None


# --- in the grader: the run nobody interrupted -----------------------------------------------


def uninterrupted(world_size: int) -> dict:
    """EPOCHS epochs of the exercise's training on ``world_size`` ranks, without a failure, in one process.

    Each step: the mean over ranks of each rank's mean loss on its batch (what DDP's averaged
    gradients are the gradient of), then SGD with momentum, written out (torch.optim would import
    torch._dynamo here).
    """
    from torch.utils.data import DistributedSampler

    with torch.random.fork_rng():
        model = build_model()
    dataset = build_dataset()
    x_all, y_all = dataset.tensors
    buffers: dict = {}
    for epoch in range(EPOCHS):
        orders = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for step in range(NUM_SAMPLES // (world_size * BATCH_SIZE)):
            model.zero_grad()
            losses = []
            for order in orders:
                idx = torch.tensor(order[step * BATCH_SIZE:(step + 1) * BATCH_SIZE])
                losses.append(nn.functional.cross_entropy(model(x_all[idx]), y_all[idx]))
            (sum(losses) / world_size).backward()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    buf = buffers.get(name)
                    buf = p.grad.clone() if buf is None else buf.mul_(MOMENTUM).add_(p.grad)
                    buffers[name] = buf
                    p.add_(buf, alpha=-LR)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- in the grader: where the snapshot is, and what was seen, in words (the checks use these too) ----


def _snapshot_path(job: dict) -> str:
    return os.path.join(job["folder"], "snapshot", SNAPSHOT)


def _snapshot_words(found: dict) -> str:
    """The snapshot a worker found at start, in words."""
    if found.get("epoch") is not None:
        return f"the snapshot of epoch {found['epoch']}"
    keys = found.get("keys")
    held = f"its keys: {', '.join(keys)}" if keys is not None else f"a {found.get('type') or 'value'}, not a dict"
    return f"the snapshot (it holds no integer 'epoch'; {held})"


def _first_sentence(text: str, limit: int = 160) -> str:
    return re.split(r"(?<=[.!?]) ", str(text), maxsplit=1)[0][:limit]


def _short_error(text: str) -> str:
    """An error in a few words: gloo's long messages about a peer that died become one phrase."""
    for phrase in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"):
        if phrase in text:
            return f"lost a peer that died ({phrase})"
    if "connectFullMesh failed" in text:
        return "could not connect to its peers (gloo connectFullMesh failed)"
    return _first_sentence(re.sub(r"\[/[^\]]*\] ?", "", text))


def _exit_text(agent: dict) -> str:
    if agent["returncode"] is not None:
        return str(agent["returncode"])
    if agent.get("lingered_s") is not None:
        return f"no exit {agent['lingered_s']:.0f} s after the last worker ended (stopped by the grader)"
    return "no exit (stopped at the deadline)"


# --- in the grader: the timeline ----------------------------------------------------------------


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
            out.append(_worker_entry(name, w, t0, os.path.abspath(_snapshot_path(job))))
        if job["agents"]:
            codes = {node: a["returncode"] for node, a in sorted(job["agents"].items())}
            out.append({"job": name, "event": "exit", "codes": codes,
                        "text": f"{name}: torchrun exited with " + ", ".join(
                            f"node {n}: {_exit_text(job['agents'][n])}" for n in codes)})
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
        ended = f"stopped: {_short_error(w['error'])}"
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
        found_text = _snapshot_words(found)[len("the "):]
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
