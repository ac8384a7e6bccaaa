"""Exercise 05: SimpleDDP, gradient averaging written by hand: the drivers, run in each rank (the checks that
decide: grader/checks/ex05_allreduce.py).

One run per world size, in order: construct the wrapper on identical weights; use its API; train a few steps,
recording each rank's gradients after backward and after sync_gradients (and every collective call); probe
no_sync; a model with a frozen layer; last, construct on weights that differ on the last rank, under a short collective timeout so that a rank left
waiting shows up as an error.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from grader.rank import probes, rank_timeline
from grader.rank.child import describe_exception, RankContext


SEED = 5
LR = 0.1
STEPS = 3
BATCH = 4
SIZES = (6, 8, 3)  # in, hidden, out
NO_SYNC_STEP, FROZEN_STEP = 10, 20  # batch ids of the no_sync and frozen scenarios
PERTURBED = ("hidden.bias", "head.weight")  # changed on the last rank; the first is the one to name
PERTURBATION = 1e-3
MISMATCH_TIMEOUT_S = 5.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(SIZES[0], SIZES[1])
        self.head = nn.Linear(SIZES[1], SIZES[2])

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(x)))


def build_model() -> Net:
    """The same weights in every process, whatever the global random state."""
    model = Net()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for step ``step``: different on every rank."""
    g = torch.Generator().manual_seed(1000 + 100 * step + rank)
    return torch.randn(BATCH, SIZES[0], generator=g), torch.randint(0, SIZES[2], (BATCH,), generator=g)


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        return _observe(ctx)


def _observe(ctx: RankContext) -> dict:
    device = ctx.device
    events: list = []
    ddp_built: list = []
    obs: dict = {}
    with probes.watch_collectives(events), _count_torch_ddp(ddp_built):
        SimpleDDP = ctx.function("SimpleDDP")

        # 1. identical weights on every rank
        model = build_model().to(device)
        mark = len(events)
        wrapper, obs["init_error"] = _construct(SimpleDDP, model)
        obs["init_ops"] = _ops(events, mark)
        # every rank learns whether every rank got a wrapper (else all stop here)
        flag = torch.tensor([0 if wrapper is None else 1], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0:
            obs["ddp_built"] = len(ddp_built)
            return obs

        # 2. the wrapper's API
        x, _ = batch(ctx.rank, 0)
        x = x.to(device)
        obs["module_is_model"] = wrapper.module is model
        with torch.no_grad():
            obs["output"] = _cpu(wrapper(x))
            obs["model_output"] = _cpu(model(x))
        wrapper.eval()
        obs["training_after_eval"] = [m.training for m in model.modules()]
        wrapper.train()
        obs["training_after_train"] = [m.training for m in model.modules()]

        # 3. a few steps: gradients after backward, then after sync_gradients
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        steps = []
        for step in range(STEPS):
            record = {"params": _params(model)}
            optimizer.zero_grad(set_to_none=True)
            x, y = (t.to(device) for t in batch(ctx.rank, step))
            mark = len(events)
            F.cross_entropy(wrapper(x), y).backward()
            record["backward_ops"] = _ops(events, mark)
            record["local"] = _grads(model)
            mark = len(events)
            wrapper.sync_gradients()
            record["sync_ops"] = _ops(events, mark)
            record["synced"] = _grads(model)
            optimizer.step()
            steps.append(record)
        obs["steps"] = steps
        obs["final"] = _params(model)

        # 4. no_sync: silent inside, restored on exit, after an exception, when nested
        try:
            obs["no_sync"] = _probe_no_sync(wrapper, model, optimizer, events, ctx.rank, device)
        except NotImplementedError:
            raise  # still the stub: the grading says so
        except Exception as exc:  # e.g. no no_sync() at all: those checks fail, the others are still decided
            obs["no_sync"] = {"error": describe_exception(exc, ctx.learner_path)}

        # 5. a frozen layer: its .grad stays None
        frozen = build_model().to(device)
        frozen.hidden.requires_grad_(False)
        frozen_wrapper = SimpleDDP(frozen)
        x, y = (t.to(device) for t in batch(ctx.rank, FROZEN_STEP))
        F.cross_entropy(frozen_wrapper(x), y).backward()
        obs["frozen_error"] = None
        try:
            frozen_wrapper.sync_gradients()
        except Exception as exc:  # the observation: a None .grad was not skipped
            obs["frozen_error"] = {"type": type(exc).__name__, "message": str(exc)[:500]}
        obs["frozen_grads"] = _grads(frozen)
        obs["ddp_built"] = len(ddp_built)

        # 6. last: weights that differ on the last rank. A short timeout turns a
        # rank left waiting in a broadcast into an error instead of a hang.
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=MISMATCH_TIMEOUT_S))
        model = build_model().to(device)
        if ctx.rank == ctx.world_size - 1 and ctx.world_size > 1:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in PERTURBED:
                        p.add_(PERTURBATION)
        mark = len(events)
        _, error = _construct(SimpleDDP, model)
        obs["mismatch_error"] = error
        obs["mismatch_ops"] = _ops(events, mark)
    return obs


def _probe_no_sync(wrapper, model, optimizer, events, rank, device) -> dict:
    out: dict = {}
    optimizer.zero_grad(set_to_none=True)
    x, y = (t.to(device) for t in batch(rank, NO_SYNC_STEP))
    mark = len(events)
    with wrapper.no_sync():
        F.cross_entropy(wrapper(x), y).backward()
        out["before_sync"] = _grads(model)
        wrapper.sync_gradients()
        out["after_sync"] = _grads(model)
    out["inside_ops"] = _ops(events, mark)

    mark = len(events)
    wrapper.sync_gradients()
    out["after_exit_ops"] = _ops(events, mark)

    out["exception_propagated"] = False
    try:
        with wrapper.no_sync():
            raise _Marker()
    except _Marker:
        out["exception_propagated"] = True
    mark = len(events)
    wrapper.sync_gradients()
    out["after_exception_ops"] = _ops(events, mark)

    with wrapper.no_sync():
        with wrapper.no_sync():
            pass
        mark = len(events)
        wrapper.sync_gradients()
        out["nested_ops"] = _ops(events, mark)
    mark = len(events)
    wrapper.sync_gradients()
    out["after_nested_ops"] = _ops(events, mark)
    return out


class _Marker(Exception):
    """Raised inside no_sync() to see that syncing comes back on."""


def _construct(cls, model):
    try:
        return cls(model), None
    except NotImplementedError:
        raise
    except Exception as exc:  # the observation: which rank raised what
        return None, {"type": type(exc).__name__, "message": str(exc)[:500]}


@contextlib.contextmanager
def _count_torch_ddp(built: list):
    """Record every construction of torch's DistributedDataParallel (subclasses too)."""
    cls = torch.nn.parallel.DistributedDataParallel
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    cls.__init__ = __init__
    try:
        yield built
    finally:
        cls.__init__ = original


def _ops(events: list, mark: int) -> list[str]:
    return [e["op"] for e in events[mark:]]


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().clone()


def _params(model: nn.Module) -> dict:
    return {name: _cpu(p) for name, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict:
    return {name: None if p.grad is None else _cpu(p.grad) for name, p in model.named_parameters()}
