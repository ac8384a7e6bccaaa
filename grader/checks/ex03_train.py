"""Exercise 03: train_ddp, a whole DDP training loop.

Rank side: hand train_ddp a model factory whose model logs every training
forward, a dataset whose rows identify its samples, and probes on the sampler
(every order it hands out), optimizer steps, gradient clipping, DDP's
constructor and every write into the checkpoint's folder; after train_ddp
returns, the threads that would keep the process alive. Parent side: find the
batches that fed optimizer steps and the sampler order each came from, replay
the same global batches in one process, and decide.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from grader.rank import probes, untrusted
from grader.catalog import CLAIM
from grader.compare import first_difference, largest_difference
from grader.rank.drivers.shared.recording import cpu_state
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.drivers.ex03_train import (BATCH_SIZE, EPOCHS, IN_FEATURES, LR, STEPS_PER_EPOCH, THREAD_GRACE_S,
                                            TinyNet, make_dataset, rank_main)


TOLERANCE = 1e-5


def grade(g: Grader) -> None:
    started = timelines.clock()
    # The kernel counts the bytes between the ranks: gradients that cross are what DDP is for.
    outcomes = g.run_at_once([g.Run(rank_main, world_size, traffic=world_size >= 2) for world_size in g.world_sizes])
    for world_size, outcome in zip(g.world_sizes, outcomes):
        timelines.keep(g, outcome, f"world size {world_size}", started=started)
        check_run(g, outcome.results(), world_size, outcome.traffic)


def check_run(g, ranks: list[dict], world_size: int, counted=None) -> None:
    num_samples = ranks[0]["num_samples"]
    dataset = make_dataset(num_samples)
    index_of = {row.numpy().tobytes(): i for i, row in enumerate(dataset.tensors[0])}
    trained = [training_steps(r["events"], index_of) for r in ranks]

    check_uses_ddp(g, ranks, world_size, counted)
    check_sampler(g, ranks, trained, world_size)
    check_batch_size(g, trained, world_size)
    check_shards(g, trained, num_samples, world_size)
    check_set_epoch(g, ranks, trained, world_size)
    check_parameters(g, ranks, trained, dataset, world_size)
    check_checkpoint(g, ranks, world_size)
    for rank, r in enumerate(ranks):
        g.record("group-destroyed", not r["initialized_after"],
                 f"rank {rank}: the process group is still initialized after train_ddp returned",
                 rank=rank, world_size=world_size)
        ret = r["returned"]
        if ret["is_ddp"]:
            msg = "train_ddp returned the DistributedDataParallel wrapper; return ddp_model.module"
        elif not ret["is_built_model"]:
            msg = f"train_ddp returned {ret['type']}, not the model built by model_fn"
        else:
            msg = ""
        g.record("returns-module", not msg, f"rank {rank}: {msg}", rank=rank, world_size=world_size)
    check_threads(g, ranks, world_size)


def _indices(x: torch.Tensor, index_of: dict) -> list[int]:
    return [index_of.get(row.numpy().tobytes(), -1) for row in x.reshape(-1, IN_FEATURES)]


def training_steps(events: list, index_of: dict) -> dict:
    """What fed this rank's optimizer steps, from its events in order.

    Each step: ``indices`` (the samples of the last training forward before it),
    ``iteration`` (the index, among ``iterations``, of the sampler iteration that
    handed them out: the latest one begun before that forward whose order holds
    them, consecutively; None when none does) and ``clips`` (gradient clipping
    since the previous step). A peek at a batch, an evaluation pass or anything
    else that draws from the sampler without a step in between feeds no step.
    Without any optimizer step seen (a hand-written update), every training
    forward counts as one.
    """
    iterations: list = []
    forwards: list = []
    steps: list = []
    clips: list = []
    last = None
    for event in events:
        what = event["what"]
        if what == "iter":
            iterations.append(event)
        elif what == "forward":
            last = {"indices": _indices(event["x"], index_of), "begun": len(iterations)}
            forwards.append(last)
        elif what == "clip":
            clips.append({k: v for k, v in event.items() if k != "what"})
        elif what == "step" and last is not None:
            steps.append({**last, "clips": clips})
            clips = []
    if not any(e["what"] == "step" for e in events):
        steps = [{**f, "clips": []} for f in forwards]
    for step in steps:
        step["iteration"] = _source_iteration(step["indices"], iterations[:step.pop("begun")])
    return {"steps": steps, "iterations": iterations,
            "set_epoch": [e for e in events if e["what"] == "set_epoch"]}


def _source_iteration(indices: list[int], begun: list) -> int | None:
    if not indices or -1 in indices:
        return None
    for number in range(len(begun) - 1, -1, -1):
        order = begun[number]["order"]
        start = next((i for i, v in enumerate(order) if v == indices[0]), None)
        if start is not None and order[start:start + len(indices)] == indices:
            return number
    return None


def _epochs(trained: dict) -> list[list[int]] | None:
    """The samples of each epoch, in order: the steps grouped by the sampler order they came from.

    Iterations that hand out the same order (an evaluation pass over the
    training loader, an epoch without set_epoch) count as one. None when some
    step's batch came from no sampler iteration seen.
    """
    steps, iterations = trained["steps"], trained["iterations"]
    if not steps or any(s["iteration"] is None for s in steps):
        return None
    groups: dict[tuple, list[int]] = {}
    for step in steps:
        groups.setdefault(tuple(iterations[step["iteration"]]["order"]), []).extend(step["indices"])
    return list(groups.values())


def gradient_bytes() -> int:
    """The bytes of one rank's gradients of the model (float32), what DDP all-reduces at each optimizer step."""
    return sum(p.numel() * 4 for p in TinyNet().parameters())


def least_sent() -> int:
    """What each rank sends the others at the least over a training (the kernel's count): half of its gradients'
    bytes at each of the EPOCHS * STEPS_PER_EPOCH optimizer steps. A ring all-reduce sends 2 (W - 1) / W of them
    and gloo adds 96 bytes of header to each message; half leaves room for a hook that casts them to float16.
    Measured: 13-25 KB from each rank of the reference and of the right answers in tests/right, 0.4-2.9 KB from
    tests/hostile/03_trains_alone.py (a DistributedDataParallel built and never used), against 3.8 KB here."""
    return EPOCHS * STEPS_PER_EPOCH * gradient_bytes() // 2


def check_uses_ddp(g, ranks, world_size, counted=None) -> None:
    """uses-ddp: a rank that recorded no DistributedDataParallel of model_fn()'s model fails it by name (a claim,
    believed when it fails). What passes it is what the kernel counted (``counted``, a grader.traffic.RunTraffic):
    the gradients of every step crossed from each rank to the others. Where the counters cannot be read (NCCL, a
    kernel that refuses them) or one rank has no other, the records decide, as a claim."""
    for rank, r in enumerate(ranks):
        if not r["wraps"]:
            g.record("uses-ddp", False, f"rank {rank} never built a DistributedDataParallel",
                     rank=rank, world_size=world_size, evidence=CLAIM)
            return
        if all(w["built_index"] is None for w in r["wraps"]):
            g.record("uses-ddp", False, f"rank {rank} wrapped something other than the model from model_fn()",
                     rank=rank, world_size=world_size, evidence=CLAIM)
            return
    if counted is None or world_size < 2:
        g.record("uses-ddp", True, evidence=CLAIM)
        return
    least = least_sent()
    for rank in range(world_size):
        if rank in counted.uncounted():
            why = ("its process never let the grader read its sockets (it asks as its group is made and destroyed, "
                   "and as the run ends)")
        elif counted.out_of(rank) < least:
            why = (f"it sent the other ranks {counted.out_of(rank):,} bytes over the whole training (the kernel's "
                   f"count), where DDP's all-reduce of {EPOCHS * STEPS_PER_EPOCH} optimizer steps' gradients "
                   f"({gradient_bytes():,} bytes each) sends at least {least:,}: its gradients never crossed, so "
                   "each rank trained on its own (or on data it fetched itself)")
        else:
            continue
        g.record("uses-ddp", False, f"rank {rank} recorded a DistributedDataParallel, but {why}", rank=rank,
                 world_size=world_size)
        return
    g.record("uses-ddp", True)


def check_sampler(g, ranks, trained, world_size) -> None:
    for rank, t in enumerate(trained):
        iters = t["iterations"]
        if not iters:
            g.record("distributed-sampler", False, f"rank {rank} never drew from a DistributedSampler",
                     rank=rank, world_size=world_size)
            continue
        feeding = sorted({s["iteration"] for s in t["steps"]} - {None})
        if t["steps"] and not feeding:
            g.record("distributed-sampler", False, f"rank {rank}: no training batch came from a "
                     "DistributedSampler (one was iterated, but not to feed the optimizer steps)",
                     rank=rank, world_size=world_size)
            continue
        used = [iters[i] for i in feeding] or iters
        bad = next((e for e in used if not e["shuffle"] or e["num_replicas"] != world_size or e["rank"] != rank),
                   None)
        if bad is None:
            g.record("distributed-sampler", True)
        elif not bad["shuffle"]:
            g.record("distributed-sampler", False, f"rank {rank}: the DistributedSampler has shuffle=False",
                     rank=rank, world_size=world_size)
        else:
            g.record("distributed-sampler", False, f"rank {rank}: the sampler thinks it is rank {bad['rank']} "
                     f"of {bad['num_replicas']}", rank=rank, world_size=world_size)


def check_batch_size(g, trained, world_size) -> None:
    for rank, t in enumerate(trained):
        for step, s in enumerate(t["steps"]):
            if len(s["indices"]) != BATCH_SIZE:
                g.record("batch-size", False, f"rank {rank}, step {step}: a batch of {len(s['indices'])} items, "
                         f"expected batch_size={BATCH_SIZE}", rank=rank, world_size=world_size)
                return
    g.record("batch-size", bool(trained[0]["steps"]), "no training batch was seen (did the model run forward?)",
             world_size=world_size)


def _equal_slices(trained: dict) -> list[list[int]]:
    steps = trained["steps"]
    per = max(1, len(steps) // EPOCHS)
    return [[i for s in steps[e * per:(e + 1) * per] for i in s["indices"]] for e in range(EPOCHS)]


def check_shards(g, trained, num_samples, world_size) -> None:
    groups = [_epochs(t) or _equal_slices(t) for t in trained]
    for epoch in range(min(len(gr) for gr in groups)):
        owner: dict[int, int] = {}
        for rank in range(world_size):
            for i in groups[rank][epoch]:
                if i in owner and owner[i] != rank:
                    g.record("shards-disjoint", False, f"epoch {epoch}: sample {i} went to rank {owner[i]} "
                             f"and rank {rank}", rank=rank, world_size=world_size)
                    return
                owner.setdefault(i, rank)
        unused = sorted(set(range(num_samples)) - set(owner))
        if unused:
            g.record("shards-disjoint", False, f"epoch {epoch}: {len(unused)} of {num_samples} samples were "
                     f"never used (e.g. {', '.join(map(str, unused[:5]))})", world_size=world_size)
            return
    g.record("shards-disjoint", True)


def check_set_epoch(g, ranks, trained, world_size) -> None:
    """Judged from the steps: each epoch's steps must come from a sampler order of its own."""
    for rank, t in enumerate(trained):
        iters, steps = t["iterations"], t["steps"]
        if not iters:
            g.record("set-epoch-each-epoch", False, f"rank {rank}: no DistributedSampler was iterated",
                     rank=rank, world_size=world_size)
            return
        epochs = _epochs(t)
        if epochs is None:
            g.record("set-epoch-each-epoch", False, f"rank {rank}: the training batches did not come from the "
                     "DistributedSampler's iterations, so set_epoch cannot change their order",
                     rank=rank, world_size=world_size)
            return
        if len(epochs) >= EPOCHS:
            continue
        feeding = sorted({s["iteration"] for s in steps})
        drawn_with = [iters[i]["epoch"] for i in feeding]
        samplers = {iters[i]["sampler"] for i in feeding}
        if not t["set_epoch"]:
            msg = (f"rank {rank} never called set_epoch: all {len(drawn_with)} epochs drew with epoch "
                   f"{drawn_with[0]}, so they all had the same order")
        elif not samplers & {c["sampler"] for c in t["set_epoch"]}:
            msg = f"rank {rank} called set_epoch on a sampler the DataLoader does not use"
        else:
            msg = (f"rank {rank}: the {len(drawn_with)} epochs drew their data with sampler.epoch = {drawn_with}, "
                   f"so {len(epochs)} order(s) served {EPOCHS} epochs (set_epoch(epoch) before each epoch's loop)")
        g.record("set-epoch-each-epoch", False, msg, rank=rank, world_size=world_size)
        return
    g.record("set-epoch-each-epoch", True)


def check_parameters(g, ranks, trained, dataset, world_size) -> None:
    finals = [r["final"] for r in ranks]
    identical = True
    for rank in range(1, world_size):
        found = first_difference(finals[rank], finals[0])
        if found is not None:
            g.record("params-identical", False, f"parameter {found.name} differs between rank 0 and rank {rank} "
                     f"(by up to {found.max_abs:.3g})", rank=rank, world_size=world_size)
            identical = False
            break
    if identical:
        g.record("params-identical", True)

    initial = ranks[0]["initial"]
    changed = any(not torch.equal(initial[k], finals[0][k]) for k in initial)
    g.record("params-changed", changed, "rank 0's parameters are exactly what model_fn() built: no step "
             "changed them", rank=0, world_size=world_size)

    steps = [[s["indices"] for s in t["steps"]] for t in trained]
    clips = [s["clips"] for s in trained[0]["steps"]]
    counts = [len(s) for s in steps]
    if len(set(counts)) != 1:
        g.record("matches-single-process", False, "the ranks took different numbers of steps: "
                 + ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts)), world_size=world_size)
        return
    expected_steps = EPOCHS * STEPS_PER_EPOCH
    replay = replay_single_process(initial, steps, dataset, LR, clips)
    name, diff = _largest_difference(replay, finals[0])
    if diff <= TOLERANCE:
        g.record("matches-single-process", True)
        return
    msg = (f"after {counts[0]} steps, parameter {name} of rank 0 differs from one process training on the "
           f"same global batches by {diff:.3g} (tolerance {TOLERANCE:g})")
    if any(clips):
        msg += " (the replay clipped the gradients as rank 0 did)"
    summed = replay_single_process(initial, steps, dataset, LR * world_size, clips)
    if _largest_difference(summed, finals[0])[1] <= TOLERANCE:
        msg += f"; it matches gradients summed over the ranks (or lr x {world_size}) instead of averaged"
    elif counts[0] != expected_steps:
        msg += f"; {counts[0]} steps were taken, {expected_steps} expected ({EPOCHS} epochs x {STEPS_PER_EPOCH})"
    g.record("matches-single-process", False, msg, rank=0, world_size=world_size)


def replay_single_process(initial: dict, steps: list, dataset: TensorDataset, lr: float,
                          clips: list | None = None) -> dict:
    """Train one model on the union of the ranks' batches, step by step: what DDP should equal.

    ``clips[step]``: the gradient clipping rank 0 applied before that step, repeated here.
    """
    model = TinyNet()
    model.load_state_dict(initial)
    loss_fn = nn.CrossEntropyLoss()
    x_all, y_all = dataset.tensors
    for step in range(len(steps[0])):
        model.zero_grad()
        # DDP averages per-rank mean losses' gradients: the mean over ranks of each rank's loss.
        losses = []
        for rank_steps in steps:
            idx = torch.tensor([i for i in rank_steps[step] if i >= 0], dtype=torch.long)
            if len(idx):
                losses.append(loss_fn(model(x_all[idx]), y_all[idx]))
        if losses:
            (sum(losses) / len(steps)).backward()
        for clip in (clips[step] if clips and step < len(clips) else []):
            if clip["kind"] == "norm":
                nn.utils.clip_grad_norm_(model.parameters(), clip["max_norm"], clip["norm_type"])
            elif clip["kind"] == "value":
                nn.utils.clip_grad_value_(model.parameters(), clip["clip_value"])
        # Plain SGD, written out: torch.optim would import torch._dynamo here (1-2 s).
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
    return cpu_state(model)


def _largest_difference(a: dict, b: dict) -> tuple[str, float]:
    found = largest_difference(a, b)
    return (found.name, found.max_abs) if found is not None else ("", 0.0)


def check_checkpoint(g, ranks, world_size) -> None:
    path = ranks[0]["checkpoint_path"]
    writers = probes.writers_of(path, [r["writes"] for r in ranks])
    others = sorted(r for r in writers if r != 0)
    if others:
        rank = others[0]
        how = sorted({probes.describe_write(w, path) for w in writers[rank]})
        g.record("checkpoint-rank0-only", False, "checkpoint_path was also written by "
                 + ", ".join(f"rank {r}" for r in others) + f" (rank {rank}: {'; '.join(how)}); only rank 0 "
                 "should save", rank=rank, world_size=world_size)
    elif not writers and not untrusted.exists(path):
        elsewhere = sorted({s["path"] for r in ranks for s in r["saves"]})
        where = f" (torch.save wrote to {', '.join(map(os.path.basename, elsewhere))})" if elsewhere else ""
        g.record("checkpoint-rank0-only", False, f"nothing was saved to checkpoint_path{where}",
                 world_size=world_size)
    else:
        g.record("checkpoint-rank0-only", True)

    if not untrusted.exists(path):
        for check in ("checkpoint-no-module-prefix", "checkpoint-loads"):
            g.record(check, False, "there is no file at checkpoint_path", world_size=world_size)
        return
    try:
        state = untrusted.load_tensors(path)
    except untrusted.Unreadable as exc:
        for check in ("checkpoint-no-module-prefix", "checkpoint-loads"):
            g.record(check, False, f"the checkpoint could not be read as tensors: {exc}", world_size=world_size)
        return
    if not isinstance(state, dict):
        for check in ("checkpoint-no-module-prefix", "checkpoint-loads"):
            g.record(check, False, f"the checkpoint holds a {type(state).__name__}, not a state_dict",
                     world_size=world_size)
        return
    prefixed = [k for k in state if str(k).startswith("module.")]
    g.record("checkpoint-no-module-prefix", not prefixed,
             f"{len(prefixed)} keys start with 'module.' (e.g. {prefixed[0] if prefixed else ''}): that is the "
             "DDP wrapper's state_dict; save ddp_model.module.state_dict()", world_size=world_size)
    model = TinyNet()
    try:
        model.load_state_dict(state, strict=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()
        g.record("checkpoint-loads", False, "load_state_dict(strict=True) into model_fn() failed: "
                 + " ".join(first[:3])[:400], world_size=world_size)
        return
    name, diff = _largest_difference(cpu_state(model), ranks[0]["final"])
    g.record("checkpoint-loads", diff == 0.0, f"the checkpoint's {name} differs from the trained model's by "
             f"{diff:.3g}: was it saved before training finished?", world_size=world_size)


def check_threads(g, ranks, world_size) -> None:
    for rank, r in enumerate(ranks):
        left = r["threads_left"]
        if left:
            names = ", ".join(f"{t['name']!r} (running {t['function']})" for t in left)
            g.record("process-can-exit", False,
                     f"rank {rank}: {THREAD_GRACE_S:g} s after train_ddp returned, {len(left)} non-daemon "
                     f"thread(s) were still running: {names}. Python waits for them before the process exits, so "
                     "under torchrun the job would never end", rank=rank, world_size=world_size)
            return
    g.record("process-can-exit", True)
