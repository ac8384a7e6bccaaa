"""Exercise 09: save_checkpoint / load_checkpoint: the drivers, run in each rank (the checks that decide:
grader/checks/ex09_checkpoint.py).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from grader.rank import probes, rank_timeline
from grader.rank.drivers.shared.recording import cpu_state
from grader.rank.child import RankContext
from grader.rank.drivers.shared.learner_errors import learner_error


EPOCHS_BEFORE_SAVE = 2
TOTAL_EPOCHS = 3
REFERENCE_EPOCH = 4  # the epoch written in the grader's own checkpoint: load must return 5
SAVE_WAIT_S = 0.5  # how long rank 0's torch.save waits for the other ranks to return first
SYNC_WAIT_S = 3.0  # how long a rank back from save_checkpoint waits for the others before it leaves
MODEL_SEED = 0
FRESH_SEED = 1234  # a different initialization: a load that restores nothing is visible
DATA_SEED = 9
BATCHES_PER_EPOCH = 3
BATCH = 8
LR = 0.01
CHECKPOINT = "checkpoint.pt"
REFERENCE = "reference_checkpoint.pt"


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def epoch_batches(epoch: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches of one epoch: different for every epoch and every rank."""
    g = torch.Generator().manual_seed(DATA_SEED * 10_000 + epoch * 100 + rank)
    x = torch.randn(BATCHES_PER_EPOCH, BATCH, 6, generator=g)
    y = torch.randn(BATCHES_PER_EPOCH, BATCH, 3, generator=g)
    return list(zip(x, y))


def _wrap(model: nn.Module, ctx: RankContext) -> DDP:
    model.to(ctx.device)
    return DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)


def _train_epoch(ddp: DDP, optimizer, epoch: int, ctx: RankContext) -> None:
    for x, y in epoch_batches(epoch, ctx.rank):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x.to(ctx.device)), y.to(ctx.device))
        loss.backward()
        optimizer.step()


def _cpu(value):
    """A copy of nested plain data with every tensor moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu(v) for v in value)
    return value


@rank_timeline.traced
def save_main(ctx: RankContext) -> dict:
    """Two epochs of DDP training, then the learner's save_checkpoint, observed."""
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    torch.set_num_threads(1)
    with ctx.group():
        return _observe_save(ctx)


def _observe_save(ctx: RankContext) -> dict:
    path = os.path.join(ctx.run_dir, CHECKPOINT)
    real_save = torch.save
    write_done: list[float] = []

    def slow_save(obj, f, *args, **kwargs):
        if ctx.rank == 0:  # give a rank that does not wait every chance to return first
            markers = [os.path.join(ctx.run_dir, f"returned{r}") for r in range(1, ctx.world_size)]
            until = time.monotonic() + SAVE_WAIT_S
            while time.monotonic() < until and not all(os.path.exists(m) for m in markers):
                time.sleep(0.01)
        result = real_save(obj, f, *args, **kwargs)
        write_done.append(time.monotonic())
        return result

    saves: list = []
    writes: list = []
    obs: dict = {"path": path}
    with probes.patched(torch, "save", slow_save), probes.patched(torch.serialization, "save", slow_save), \
            probes.watch_saves(saves), probes.watch_writes(writes, ctx.run_dir):
        save_checkpoint = ctx.function("save_checkpoint")
        ctx.function("load_checkpoint")  # a missing name is reported before anything runs
        model = build_model(MODEL_SEED)
        ddp = _wrap(model, ctx)
        optimizer = build_optimizer(ddp)
        for epoch in range(EPOCHS_BEFORE_SAVE):
            _train_epoch(ddp, optimizer, epoch, ctx)
        dist.barrier()  # every rank starts save_checkpoint at the same moment
        obs["module_state"] = cpu_state(model)
        obs["optimizer_state"] = _cpu(optimizer.state_dict())
        obs["called"] = time.monotonic()
        obs["save_error"] = None
        try:
            save_checkpoint(ddp, optimizer, EPOCHS_BEFORE_SAVE - 1, path)
        except NotImplementedError:
            raise
        except Exception as exc:  # e.g. a barrier that only some ranks reach, broken when the others leave
            obs["save_error"] = learner_error(exc)
        obs["returned"] = time.monotonic()
        obs["size_at_return"] = os.path.getsize(path) if os.path.exists(path) else None
        open(os.path.join(ctx.run_dir, f"returned{ctx.rank}"), "w").close()
    obs["saves"] = saves
    obs["writes"] = writes
    obs["write_done"] = write_done
    if ctx.rank == 0:  # the grader's own checkpoint, for judging load_checkpoint apart from save_checkpoint
        real_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": REFERENCE_EPOCH},
                  os.path.join(ctx.run_dir, REFERENCE))
    # No collective of the grader's own after the learner's save: one would pair with a barrier that only
    # some ranks call. Wait (bounded) for every rank to be back instead; a rank left inside such a barrier
    # sees it fail once the others have left.
    markers = [os.path.join(ctx.run_dir, f"returned{r}") for r in range(ctx.world_size)]
    until = time.monotonic() + SYNC_WAIT_S
    while time.monotonic() < until and not all(os.path.exists(m) for m in markers):
        time.sleep(0.01)
    return obs


@rank_timeline.traced
def load_main(ctx: RankContext) -> dict:
    """In a fresh group: the learner's load_checkpoint three ways, and the resumed training."""
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    torch.set_num_threads(1)
    with ctx.group():
        return _observe_load(ctx)


def _observe_load(ctx: RankContext) -> dict:
    loads: list = []
    obs: dict = {"loads": loads, "device": str(ctx.device)}

    # Three epochs straight, with nothing of the learner's involved.
    model = build_model(MODEL_SEED)
    ddp = _wrap(model, ctx)
    optimizer = build_optimizer(ddp)
    for epoch in range(TOTAL_EPOCHS):
        _train_epoch(ddp, optimizer, epoch, ctx)
    obs["straight"] = cpu_state(model)

    with _watch_loads(loads):
        load_checkpoint = ctx.function("load_checkpoint")
        for name, wrapped in (("plain", False), ("wrapped", True)):
            model = build_model(FRESH_SEED).to(ctx.device)
            target = _wrap(model, ctx) if wrapped else model
            optimizer = build_optimizer(target)
            scenario = {"error": None, "start": None}
            first = len(loads)
            try:
                start = load_checkpoint(target, optimizer, ctx.kwargs["reference_path"])
                scenario["start"] = start if isinstance(start, (int, float, str, type(None))) else repr(start)
            except NotImplementedError:
                raise
            except Exception as exc:  # the failure is the observation
                scenario["error"] = learner_error(exc)
            scenario["loads"] = len(loads) - first
            scenario["model_state"] = cpu_state(model)
            scenario["optimizer_state"] = _cpu(optimizer.state_dict())
            obs[name] = scenario

        # The resume: a fresh group, a fresh model, the learner's own checkpoint.
        model = build_model(FRESH_SEED)
        ddp = _wrap(model, ctx)
        optimizer = build_optimizer(ddp)
        resume = {"error": None, "start": None, "epochs": []}
        try:
            start = load_checkpoint(ddp, optimizer, ctx.kwargs["checkpoint_path"])
            resume["start"] = start if isinstance(start, (int, float, str, type(None))) else repr(start)
        except NotImplementedError:
            raise
        except Exception as exc:
            resume["error"] = learner_error(exc)
    if resume["error"] is None and isinstance(resume["start"], int) and 0 <= resume["start"] <= TOTAL_EPOCHS:
        for epoch in range(resume["start"], TOTAL_EPOCHS):
            _train_epoch(ddp, optimizer, epoch, ctx)
            resume["epochs"].append(epoch)
    resume["model_state"] = cpu_state(model)
    obs["resume"] = resume
    return obs


class _watch_loads:
    """Record every torch.load: was map_location given, and where did the tensors land."""

    def __init__(self, loads: list):
        self.loads = loads
        self.stack = []

    def __enter__(self):
        original = torch.load
        loads = self.loads

        def load(f, *args, **kwargs):
            map_location = kwargs.get("map_location", args[0] if args else None)
            result = original(f, *args, **kwargs)
            loads.append({"map_location": None if map_location is None else repr(map_location)[:80],
                          "devices": sorted(_devices(result))})
            return result

        for owner in (torch, torch.serialization):
            patch = probes.patched(owner, "load", load)
            patch.__enter__()
            self.stack.append(patch)
        return loads

    def __exit__(self, *exc):
        while self.stack:
            self.stack.pop().__exit__(None, None, None)


def _devices(value, found: set | None = None) -> set:
    found = set() if found is None else found
    if isinstance(value, torch.Tensor):
        found.add(str(value.device))
    elif isinstance(value, dict):
        for v in value.values():
            _devices(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _devices(v, found)
    return found
