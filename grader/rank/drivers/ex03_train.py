"""Exercise 03: train_ddp, a whole DDP training loop: the drivers, run in each rank (the checks that decide:
grader/checks/ex03_train.py).

Hand train_ddp a model factory whose model logs every training forward, a dataset whose rows identify its
samples, and probes on the sampler (every order it hands out), optimizer steps, gradient clipping, DDP's
constructor and every write into the checkpoint's folder; after train_ddp returns, the threads that would keep
the process alive.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

from grader.rank import probes, rank_timeline
from grader.rank.drivers.shared.recording import cpu_state
from grader.rank.child import RankContext


IN_FEATURES, HIDDEN, CLASSES = 8, 16, 4
BATCH_SIZE = 4
STEPS_PER_EPOCH = 3
EPOCHS = 3
LR = 0.1
THREAD_GRACE_S = 1.0  # how long threads still running after train_ddp returns get to finish


class TinyNet(nn.Module):
    """The model model_fn builds; it logs the inputs of every forward run with gradients enabled."""

    def __init__(self, events: list | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
        self._events = events

    def forward(self, x):
        # Every forward that can feed a step, in training mode or not: this model computes the same
        # either way, so an evaluation pass that leaves it in eval mode changes nothing that matters.
        if self._events is not None and torch.is_grad_enabled():
            self._events.append({"what": "forward", "x": x.detach().to("cpu", copy=True)})
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


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    num_samples = ctx.world_size * BATCH_SIZE * STEPS_PER_EPOCH
    checkpoint_path = os.path.join(ctx.run_dir, "checkpoint.pt")
    events: list = []  # in order: sampler iterations, set_epoch, training forwards, clipping, optimizer steps
    saves: list = []
    writes: list = []
    wraps: list = []
    built: list = []
    initial: list = []

    def model_fn() -> nn.Module:
        model = TinyNet(events)
        # Ranks start from different weights on purpose: DDP must make them equal.
        initial_weights(model, seed=1000 + ctx.rank)
        built.append(model)
        initial.append(cpu_state(model))
        return model

    with probes.platform_start_method(), _watch_sampler(events), _watch_steps(events), _watch_ddp(wraps, built), \
            probes.watch_saves(saves), probes.watch_writes(writes, ctx.run_dir):
        train_ddp = ctx.function("train_ddp")
        returned = train_ddp(ctx.rank, ctx.world_size, model_fn=model_fn, dataset=make_dataset(num_samples),
                             epochs=EPOCHS, batch_size=BATCH_SIZE, lr=LR, checkpoint_path=checkpoint_path)
        threads_left = probes.threads_left_running(THREAD_GRACE_S)

    trained = _trained_model(built, wraps)
    return {
        "num_samples": num_samples,
        "checkpoint_path": os.path.abspath(checkpoint_path),
        "events": events,
        "saves": [s for s in saves if s["path"] is not None],
        "writes": writes,
        "wraps": wraps,
        "models_built": len(built),
        "initial": initial[0] if initial else None,
        "final": cpu_state(built[trained]) if built else None,
        "returned": _describe_return(returned, built),
        "initialized_after": dist.is_initialized(),
        "threads_left": threads_left,
    }


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
    """Record DistributedSampler.set_epoch calls and every iteration: its settings and the order it hands out."""

    def __init__(self, events: list):
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
            # DistributedSampler computes its whole order up front: handing out a list of it is the same.
            order = [int(i) for i in watcher.iter(sampler)]
            watcher.events.append({
                "what": "iter", "sampler": watcher._id(sampler), "epoch": int(sampler.epoch),
                "seed": int(sampler.seed), "shuffle": bool(sampler.shuffle),
                "num_replicas": int(sampler.num_replicas), "rank": int(sampler.rank),
                "drop_last": bool(sampler.drop_last), "order": order,
            })
            return iter(order)

        DistributedSampler.set_epoch = set_epoch
        DistributedSampler.__iter__ = iterate
        return self

    def __exit__(self, *exc):
        DistributedSampler.set_epoch = self.set_epoch
        DistributedSampler.__iter__ = self.iter


class _watch_steps:
    """Record every optimizer step, and gradient clipping (which the replay must repeat)."""

    def __init__(self, events: list):
        self.events = events
        self.patches: list = []

    def __enter__(self):
        import inspect

        import torch.nn.utils.clip_grad as clip_grad
        from torch.optim.optimizer import register_optimizer_step_post_hook

        events = self.events
        self.handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: events.append({"what": "step"}))
        for name, kind, arguments in (("clip_grad_norm_", "norm", ("max_norm", "norm_type")),
                                      ("clip_grad_value_", "value", ("clip_value",))):
            original = getattr(clip_grad, name)
            signature = inspect.signature(original)

            def clip(*args, _original=original, _signature=signature, _kind=kind, _arguments=arguments, **kwargs):
                record = {"what": "clip", "kind": _kind}
                try:
                    bound = _signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    for argument in _arguments:
                        record[argument] = float(bound.arguments[argument])
                except Exception:  # odd arguments: the call itself says what is wrong with them
                    record["kind"] = "unknown"
                events.append(record)
                return _original(*args, **kwargs)

            for owner in (clip_grad, torch.nn.utils):
                patch = probes.patched(owner, name, clip)
                patch.__enter__()
                self.patches.append(patch)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        while self.patches:
            self.patches.pop().__exit__(None, None, None)


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
