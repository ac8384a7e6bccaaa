"""Exercise 08: BucketedDDP, bucketed all-reduces that overlap backward: the drivers, run in each rank (the
checks that decide: grader/checks/ex08_bucketed.py).

Build a small model whose parameters and buffer differ on every rank (seeded by rank), with one frozen layer
in the middle; wrap it in the learner's BucketedDDP with several caps to read the buckets, then train a few
steps while recording, in order, every torch.distributed call (with its async_op flag), the moment the first
layer's gradient is ready and the end of loss.backward(). All of it three times: the model in float32, in
float64, and with one layer in float64 among float32 ones (so a bucket holds both), since bucket sizes and the
precision of the average depend on each parameter's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.rank import probes, rank_timeline
from grader.rank.child import RankContext


MIB = 2**20


# Caps in bytes (given to the learner in MiB), each chosen so that a common
# mistake gives other buckets: an exact fit (656, 864), forward order (3200),
# MB for MiB (656, 864, 3200), everything in one bucket, every parameter alone.
LAYOUT_CAPS_BYTES = [656, 864, 3200, 25 * MIB, 100]
TRAIN_CAP_BYTES = 3200
STEPS = 3
BATCH = 8
LR = 0.1
SHIFT = 0.25  # passed as a keyword argument to forward on the second step
FIRST_LAYER = "fc1.weight"


# The dtypes graded: every layer float32, every layer float64, and fc2 in float64 among float32 layers
# (with the training cap, fc2.bias then shares a bucket with float32 gradients).
PLANS = {"float32": {}, "float64": {"*": torch.float64}, "mixed": {"fc2": torch.float64}}
LAYOUT_PLANS = ("float32", "float64")  # the mixed model's buckets may also be split by dtype, as DDP does


class Net(torch.nn.Module):
    """Three trainable layers around a frozen one, and a buffer used in forward."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 24)
        self.frozen = torch.nn.Linear(24, 24)
        self.fc2 = torch.nn.Linear(24, 32)
        self.fc3 = torch.nn.Linear(32, 4)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.ones(24))

    def forward(self, x, *, shift: float = 0.0):
        # Each layer gets its input in its own dtype (a no-op when all are float32).
        h = torch.tanh(self.fc1(x.to(self.fc1.weight.dtype)))
        h = torch.tanh(self.frozen(h.to(self.frozen.weight.dtype))) * self.scale + shift
        h = torch.tanh(self.fc2(h.to(self.fc2.weight.dtype)))
        return self.fc3(h.to(self.fc3.weight.dtype))


def build_model(rank: int, plan: str = "float32") -> Net:
    """Rank ``rank``'s model before the wrapper: different on every rank, on purpose."""
    torch.manual_seed(1000 + rank)
    model = Net()
    with torch.no_grad():
        model.scale.uniform_(0.5, 1.5)
    for name, dtype in PLANS[plan].items():
        (model if name == "*" else getattr(model, name)).to(dtype)
    return model


def make_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 4, generator=generator)


def forward_kwargs(step: int) -> dict:
    return {"shift": SHIFT} if step == 1 else {}


def _state(model: torch.nn.Module) -> dict:
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {name: t.detach().cpu().clone() for name, t in tensors.items()}


def _bucket_names(buckets, model: torch.nn.Module) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for bucket in buckets:
        row = []
        for item in bucket:
            row.append(names.get(id(item), f"<a {type(item).__name__} that is not a parameter of the module>"))
        out.append(row)
    return out


@rank_timeline.traced
def bucket_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        return _observe(ctx)


def _observe(ctx: RankContext) -> dict:
    events: list = []
    with probes.watch_collectives(events):
        BucketedDDP = ctx.function("BucketedDDP")
        return {plan: _observe_plan(ctx, BucketedDDP, plan, events) for plan in PLANS}


def _observe_plan(ctx: RankContext, BucketedDDP, plan: str, events: list) -> dict:
    layouts = []
    for cap_bytes in LAYOUT_CAPS_BYTES if plan in LAYOUT_PLANS else ():
        model = build_model(ctx.rank, plan).to(ctx.device)
        wrapper = BucketedDDP(model, cap_bytes / MIB)
        layouts.append(_bucket_names(getattr(wrapper, "buckets", []), model))

    model = build_model(ctx.rank, plan).to(ctx.device)
    first_layer = dict(model.named_parameters())[FIRST_LAYER]
    # Registered before the learner's hooks, so it runs before theirs on this parameter.
    first_layer.register_post_accumulate_grad_hook(lambda p: events.append({"op": "first-layer-grad-ready"}))
    ddp = BucketedDDP(model, TRAIN_CAP_BYTES / MIB)
    after_init = _state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    steps = []
    with rank_timeline.region(training(plan)):
        for step in range(STEPS):
            x, y = (t.to(ctx.device) for t in make_batch(step, ctx.rank))
            first = len(events)
            out = ddp(x, **forward_kwargs(step))
            loss = F.mse_loss(out, y.to(out.dtype))
            loss.backward()
            events.append({"op": "backward-returned"})
            ddp.finish_gradient_synchronization()
            events.append({"op": "finish-returned"})
            grads = {n: None if p.grad is None else p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
            step_events = [dict(e) for e in events[first:]]
            optimizer.step()
            optimizer.zero_grad()
            steps.append({"grads": grads, "events": step_events, "state": _state(model)})
    return {"layouts": layouts, "after_init": after_init, "steps": steps,
            "train_buckets": len(getattr(ddp, "buckets", None) or [])}


def training(plan: str) -> str:
    """What the timeline calls the training steps of ``plan``."""
    return f"{plan}, {STEPS} training steps"
