"""Exercise 03: train_ddp, a whole DDP training loop.

Rank side: hand train_ddp a model factory whose model logs every training
batch, a dataset whose rows identify its samples, and probes on the sampler,
DDP's constructor and torch.save. Parent side: map logged batches back to
sample indices, replay the same global batches in one process, and decide.
"""

from __future__ import annotations

import io
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

from grader import probes
from grader.compare import first_difference, largest_difference
from grader.child import RankContext

IN_FEATURES, HIDDEN, CLASSES = 8, 16, 4
BATCH_SIZE = 4
STEPS_PER_EPOCH = 3
EPOCHS = 3
LR = 0.1
TOLERANCE = 1e-5


class TinyNet(nn.Module):
    """The model model_fn builds; it logs the inputs of every training forward."""

    def __init__(self, log: list | None = None, iterations: list | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
        self._log = log
        self._iterations = iterations

    def forward(self, x):
        if self._log is not None and self.training and torch.is_grad_enabled():
            self._log.append({"x": x.detach().to("cpu", copy=True), "epoch_seen": len(self._iterations) - 1})
        return self.net(x)


def make_dataset(num_samples: int) -> TensorDataset:
    """Random rows (each identifies its sample) and class labels; the same in every process."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(num_samples, IN_FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (num_samples,), generator=g)
    return TensorDataset(x, y)


def initial_weights(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


# --- in each rank ---------------------------------------------------------------------


def rank_main(ctx: RankContext) -> dict:
    num_samples = ctx.world_size * BATCH_SIZE * STEPS_PER_EPOCH
    checkpoint_path = os.path.join(ctx.run_dir, "checkpoint.pt")
    batches: list = []
    sampler_events: list = []
    saves: list = []
    wraps: list = []
    built: list = []
    initial: list = []

    def model_fn() -> nn.Module:
        model = TinyNet(batches, [e for e in sampler_events if e["what"] == "iter"])
        # Ranks start from different weights on purpose: DDP must make them equal.
        initial_weights(model, seed=1000 + ctx.rank)
        built.append(model)
        initial.append(_cpu_state(model))
        return model

    with _watch_sampler(sampler_events, batches, built), _watch_ddp(wraps, built), probes.watch_saves(saves):
        train_ddp = ctx.function("train_ddp")
        returned = train_ddp(ctx.rank, ctx.world_size, model_fn=model_fn, dataset=make_dataset(num_samples),
                             epochs=EPOCHS, batch_size=BATCH_SIZE, lr=LR, checkpoint_path=checkpoint_path)

    trained = _trained_model(built, wraps)
    return {
        "num_samples": num_samples,
        "checkpoint_path": checkpoint_path,
        "batches": [{"x": b["x"], "epoch_seen": b["epoch_seen"]} for b in batches],
        "sampler_events": sampler_events,
        "saves": saves,
        "wraps": wraps,
        "models_built": len(built),
        "initial": initial[0] if initial else None,
        "final": _cpu_state(built[trained]) if built else None,
        "returned": _describe_return(returned, built),
        "initialized_after": dist.is_initialized(),
    }


def _cpu_state(model: nn.Module) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _trained_model(built: list, wraps: list) -> int:
    """The model that was wrapped in DDP (the last one built if none was)."""
    for w in reversed(wraps):
        if w["built_index"] is not None:
            return w["built_index"]
    return len(built) - 1


def _describe_return(value, built: list) -> dict:
    return {
        "type": type(value).__name__,
        "is_ddp": isinstance(value, DistributedDataParallel),
        "is_built_model": any(value is m for m in built),
    }


class _watch_sampler:
    """Record DistributedSampler.set_epoch calls and every iteration (with the epoch it used)."""

    def __init__(self, events: list, batches: list, built: list):
        self.events = events
        self.ids: dict[int, int] = {}

    def _id(self, sampler) -> int:
        return self.ids.setdefault(id(sampler), len(self.ids))

    def __enter__(self):
        self.set_epoch = DistributedSampler.set_epoch
        self.iter = DistributedSampler.__iter__
        watcher = self

        def set_epoch(sampler, epoch):
            watcher.events.append({"what": "set_epoch", "sampler": watcher._id(sampler), "epoch": int(epoch)})
            return watcher.set_epoch(sampler, epoch)

        def iterate(sampler):
            watcher.events.append({
                "what": "iter", "sampler": watcher._id(sampler), "epoch": int(sampler.epoch),
                "shuffle": bool(sampler.shuffle), "num_replicas": int(sampler.num_replicas),
                "rank": int(sampler.rank), "drop_last": bool(sampler.drop_last),
            })
            return watcher.iter(sampler)

        DistributedSampler.set_epoch = set_epoch
        DistributedSampler.__iter__ = iterate
        return self

    def __exit__(self, *exc):
        DistributedSampler.set_epoch = self.set_epoch
        DistributedSampler.__iter__ = self.iter


class _watch_ddp:
    """Record each DistributedDataParallel construction and which model it wrapped."""

    def __init__(self, wraps: list, built: list):
        self.wraps, self.built = wraps, built

    def __enter__(self):
        self.original = DistributedDataParallel.__init__
        watcher = self

        def init(ddp, module, *args, **kwargs):
            index = next((i for i, m in enumerate(watcher.built) if m is module), None)
            watcher.wraps.append({"built_index": index})
            return watcher.original(ddp, module, *args, **kwargs)

        DistributedDataParallel.__init__ = init
        return self

    def __exit__(self, *exc):
        DistributedDataParallel.__init__ = self.original


# --- in the grader --------------------------------------------------------------------


def grade(g) -> None:
    for world_size in g.world_sizes:
        outcome = g.run("rank_main", world_size)
        check_run(g, outcome.results(), world_size)


def check_run(g, ranks: list[dict], world_size: int) -> None:
    num_samples = ranks[0]["num_samples"]
    dataset = make_dataset(num_samples)
    index_of = {row.numpy().tobytes(): i for i, row in enumerate(dataset.tensors[0])}
    steps = [[_indices(b["x"], index_of) for b in r["batches"]] for r in ranks]
    epochs_of = [[b["epoch_seen"] for b in r["batches"]] for r in ranks]

    check_uses_ddp(g, ranks, world_size)
    check_sampler(g, ranks, world_size)
    check_batch_size(g, steps, world_size)
    check_shards(g, steps, epochs_of, num_samples, world_size)
    check_set_epoch(g, ranks, steps, epochs_of, world_size)
    check_parameters(g, ranks, steps, dataset, world_size)
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


def _indices(x: torch.Tensor, index_of: dict) -> list[int]:
    return [index_of.get(row.numpy().tobytes(), -1) for row in x.reshape(-1, IN_FEATURES)]


def check_uses_ddp(g, ranks, world_size) -> None:
    for rank, r in enumerate(ranks):
        if not r["wraps"]:
            g.record("uses-ddp", False, f"rank {rank} never built a DistributedDataParallel",
                     rank=rank, world_size=world_size)
        elif all(w["built_index"] is None for w in r["wraps"]):
            g.record("uses-ddp", False, f"rank {rank} wrapped something other than the model from model_fn()",
                     rank=rank, world_size=world_size)
        else:
            g.record("uses-ddp", True)


def check_sampler(g, ranks, world_size) -> None:
    for rank, r in enumerate(ranks):
        iters = [e for e in r["sampler_events"] if e["what"] == "iter"]
        if not iters:
            g.record("distributed-sampler", False, f"rank {rank} never drew from a DistributedSampler",
                     rank=rank, world_size=world_size)
            continue
        bad = next((e for e in iters if not e["shuffle"] or e["num_replicas"] != world_size or e["rank"] != rank),
                   None)
        if bad is None:
            g.record("distributed-sampler", True)
        elif not bad["shuffle"]:
            g.record("distributed-sampler", False, f"rank {rank}: the DistributedSampler has shuffle=False",
                     rank=rank, world_size=world_size)
        else:
            g.record("distributed-sampler", False, f"rank {rank}: the sampler thinks it is rank {bad['rank']} "
                     f"of {bad['num_replicas']}", rank=rank, world_size=world_size)


def check_batch_size(g, steps, world_size) -> None:
    for rank, batches in enumerate(steps):
        for step, batch in enumerate(batches):
            if len(batch) != BATCH_SIZE:
                g.record("batch-size", False, f"rank {rank}, step {step}: a batch of {len(batch)} items, "
                         f"expected batch_size={BATCH_SIZE}", rank=rank, world_size=world_size)
                return
    g.record("batch-size", bool(steps[0]), "no training batch was seen (did the model run forward?)",
             world_size=world_size)


def _epoch_groups(batches: list, epochs_seen: list) -> list[list]:
    """Indices drawn per epoch: by sampler iteration when known, else equal slices."""
    if batches and all(e >= 0 for e in epochs_seen) and len(set(epochs_seen)) == EPOCHS:
        groups = [[] for _ in range(EPOCHS)]
        for batch, e in zip(batches, epochs_seen):
            groups[min(e, EPOCHS - 1)].extend(batch)
        return groups
    per = max(1, len(batches) // EPOCHS)
    return [[i for b in batches[e * per:(e + 1) * per] for i in b] for e in range(EPOCHS)]


def check_shards(g, steps, epochs_of, num_samples, world_size) -> None:
    groups = [_epoch_groups(b, e) for b, e in zip(steps, epochs_of)]
    for epoch in range(EPOCHS):
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


def check_set_epoch(g, ranks, steps, epochs_of, world_size) -> None:
    for rank, r in enumerate(ranks):
        iters = [e for e in r["sampler_events"] if e["what"] == "iter"]
        calls = [e for e in r["sampler_events"] if e["what"] == "set_epoch"]
        if not iters:
            g.record("set-epoch-each-epoch", False, f"rank {rank}: no DistributedSampler was iterated",
                     rank=rank, world_size=world_size)
            return
        drawn_with = [e["epoch"] for e in iters]
        if drawn_with[:EPOCHS] == list(range(EPOCHS)):
            continue
        used = {e["sampler"] for e in iters}
        if not calls:
            msg = (f"rank {rank} never called set_epoch: all {len(drawn_with)} epochs drew with epoch 0, "
                   "so they all had the same order")
        elif not used & {c["sampler"] for c in calls}:
            msg = f"rank {rank} called set_epoch on a sampler the DataLoader does not use"
        else:
            msg = (f"rank {rank}: the epochs drew their data with sampler.epoch = {drawn_with}, "
                   f"expected {list(range(EPOCHS))} (set_epoch(epoch) before each epoch's loop)")
        g.record("set-epoch-each-epoch", False, msg, rank=rank, world_size=world_size)
        return
    first = _epoch_groups(steps[0], epochs_of[0])
    g.record("set-epoch-each-epoch", first[0] != first[1],
             "rank 0 drew epochs 0 and 1 in the same order", rank=0, world_size=world_size)


def check_parameters(g, ranks, steps, dataset, world_size) -> None:
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

    counts = [len(s) for s in steps]
    if len(set(counts)) != 1:
        g.record("matches-single-process", False, "the ranks took different numbers of steps: "
                 + ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts)), world_size=world_size)
        return
    expected_steps = EPOCHS * STEPS_PER_EPOCH
    replay = replay_single_process(initial, steps, dataset, LR)
    name, diff = _largest_difference(replay, finals[0])
    if diff <= TOLERANCE:
        g.record("matches-single-process", True)
        return
    msg = (f"after {counts[0]} steps, parameter {name} of rank 0 differs from one process training on the "
           f"same global batches by {diff:.3g} (tolerance {TOLERANCE:g})")
    summed = replay_single_process(initial, steps, dataset, LR * world_size)
    if _largest_difference(summed, finals[0])[1] <= TOLERANCE:
        msg += f"; it matches gradients summed over the ranks (or lr x {world_size}) instead of averaged"
    elif counts[0] != expected_steps:
        msg += f"; {counts[0]} steps were taken, {expected_steps} expected ({EPOCHS} epochs x {STEPS_PER_EPOCH})"
    g.record("matches-single-process", False, msg, rank=0, world_size=world_size)


def replay_single_process(initial: dict, steps: list, dataset: TensorDataset, lr: float) -> dict:
    """Train one model on the union of the ranks' batches, step by step: what DDP should equal."""
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
        # Plain SGD, written out: torch.optim would import torch._dynamo here (1-2 s).
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
    return _cpu_state(model)


def _largest_difference(a: dict, b: dict) -> tuple[str, float]:
    found = largest_difference(a, b)
    return (found.name, found.max_abs) if found is not None else ("", 0.0)


def check_checkpoint(g, ranks, world_size) -> None:
    path = ranks[0]["checkpoint_path"]
    savers = [(rank, s) for rank, r in enumerate(ranks) for s in r["saves"]]
    to_path = [(rank, s) for rank, s in savers if s["path"] == path]
    if not to_path:
        where = f" (torch.save wrote to {savers[0][1]['path']})" if savers else ""
        g.record("checkpoint-rank0-only", False, f"nothing was saved to checkpoint_path{where}",
                 world_size=world_size)
    elif any(rank != 0 for rank, _ in to_path):
        others = sorted({rank for rank, _ in to_path if rank != 0})
        g.record("checkpoint-rank0-only", False, "checkpoint_path was also written by "
                 + ", ".join(f"rank {r}" for r in others) + "; only rank 0 should save",
                 rank=others[0], world_size=world_size)
    elif len(to_path) != 1:
        g.record("checkpoint-rank0-only", False, f"rank 0 saved to checkpoint_path {len(to_path)} times, "
                 "expected once, after training", rank=0, world_size=world_size)
    else:
        g.record("checkpoint-rank0-only", True)

    try:
        with open(path, "rb") as f:
            state = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        for check in ("checkpoint-no-module-prefix", "checkpoint-loads"):
            g.record(check, False, "there is no file at checkpoint_path", world_size=world_size)
        return
    except Exception as exc:
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
    name, diff = _largest_difference(_cpu_state(model), ranks[0]["final"])
    g.record("checkpoint-loads", diff == 0.0, f"the checkpoint's {name} differs from the trained model's by "
             f"{diff:.3g}: was it saved before training finished?", world_size=world_size)
