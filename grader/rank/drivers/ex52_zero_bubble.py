"""Exercise 52: zero_bubble_step, 13's pipeline under the ZB-H1 schedule: the drivers, run in each rank (the checks
that decide: grader/checks/ex52_zero_bubble/).

Every rank builds the grading's model in float64 from the seed the grader drew for this grading, cut into one
stage per rank, and hands the learner its own stage wrapped in :class:`ObservedStage`. Rank 0 alone gets the
batch and the last rank alone the target. Each step runs under ``probes.watch_collectives``, and the stage
writes its own marks into the same list of events, so that one list holds, in the order they happened:

- ``{"op": "F", "mb": k, "rows": n}``: the k-th forward of the stage with gradients enabled (micro-batch k);
- ``{"op": "B", "mb": k}``: autograd carries micro-batch k's gradient into the stage's output for the first time
  (its backward enters the stage: a hook on the output);
- ``{"op": "W", "mb": k}``: autograd has produced micro-batch k's gradient for every parameter of the stage (each
  forward uses each parameter through a view of its own, whose hook counts it);
- every send and receive (``op``, ``peer``, ``bytes``) and every collective.

It also counts how many micro-batches' saved activations are alive at once, as 13 does: each tensor autograd
saves for micro-batch k is wrapped (``torch.autograd.graph.saved_tensors_hooks``), and k is alive while any of
its wrappers is held by the graph (``retain_graph=True`` keeps them; the backward that does not retain frees
them). What the ranks record of themselves is their claim; the gradients and the loss are compared outside.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from grader.rank import probes, rank_timeline
from grader.rank.child import RankContext

WIDTHS = (40, 64, 96, 80, 72)  # stage r maps WIDTHS[r] features to WIDTHS[r + 1]: every link has its own size
HIDDEN = 48
CLASSES = 10
DTYPE = torch.float64

_WATCH: list = [None]  # while an ObservedStage runs its forward: what each layer passes its parameters through


class Linear(nn.Linear):
    """nn.Linear whose forward hands its parameters to the stage that runs it (:class:`ObservedStage`), which
    gives back a view of each whose gradient it can see arrive. Outside a stage's forward, plain nn.Linear."""

    def forward(self, x):
        watch = _WATCH[0]
        if watch is None:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, watch(self.weight), watch(self.bias))


def build_stages(seed: int, world_size: int) -> list[nn.Module]:
    """The model, one stage per rank: two linear layers each, the last one ending in CLASSES logits (float64)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        stages = []
        for r in range(world_size):
            if r < world_size - 1:
                body = nn.Sequential(Linear(WIDTHS[r], HIDDEN), nn.Tanh(), Linear(HIDDEN, WIDTHS[r + 1]), nn.Tanh())
            else:
                body = nn.Sequential(Linear(WIDTHS[r], HIDDEN), nn.Tanh(), Linear(HIDDEN, CLASSES))
            stages.append(body.to(DTYPE))
    return stages


def make_batch(seed: int, case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    rows = case["num_microbatches"] * case["rows"]
    g = torch.Generator().manual_seed(seed * 7919 + case["index"])
    batch = torch.randn(rows, WIDTHS[0], generator=g, dtype=DTYPE)
    return batch, torch.randint(0, CLASSES, (rows,), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def region_name(case: dict) -> str:
    """What the timeline calls the step of one case."""
    return f"the step of {case['num_microbatches']} micro-batches"


class _Saved:
    """What autograd keeps for a saved tensor while the stage's forward runs under our hooks."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _unpack(saved: _Saved):
    return saved.tensor


class ObservedStage(nn.Module):
    """The learner's stage: its layers in ``body``; each forward, backward entry and completed weight gradient
    written into ``events`` (see the module's docstring), and the saved activations counted.

    A forward under torch.no_grad (e.g. to learn the output's shape) saves nothing for backward and is not part
    of the schedule: it is recorded as "f" and left out of every check.
    """

    def __init__(self, body: nn.Module, events: list):
        super().__init__()
        self.body = body
        self.events = events
        self.forwards = 0
        self.entered: set[int] = set()  # micro-batches whose backward has entered the stage
        self.expected: dict[int, int] = {}  # micro-batch -> parameter views its forward made
        self.produced: dict[int, int] = {}  # micro-batch -> parameter gradients autograd produced for it
        self.live: dict[int, int] = {}  # micro-batch -> its saved tensors still held by autograd
        self.peak_live = 0  # the most micro-batches with saved tensors alive at one moment

    def forward(self, x):
        rows = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else 0
        if not torch.is_grad_enabled():
            self.events.append({"op": "f", "mb": -1, "rows": rows})
            return self.body(x)
        k = self.forwards
        self.forwards += 1
        self.events.append({"op": "F", "mb": k, "rows": rows})
        rank_timeline.label(f"F{k}")
        self.expected[k] = 0
        _WATCH[0] = self._watcher(k)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._packer(k), _unpack):
                out = self.body(x)
        finally:
            _WATCH[0] = None
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._entered(k))
        return out

    def _watcher(self, k: int):
        def watch(param):
            if param is None or not param.requires_grad:
                return param
            view = param.view_as(param)
            self.expected[k] += 1
            view.register_hook(self._produced(k))
            return view
        return watch

    def _produced(self, k: int):
        def hook(grad):
            self.produced[k] = self.produced.get(k, 0) + 1
            if self.produced[k] % self.expected[k] == 0:  # every parameter's gradient of k is there: W k
                self.events.append({"op": "W", "mb": k})
                rank_timeline.label(f"W{k}")
        return hook

    def _entered(self, k: int):
        def hook(grad):
            if k not in self.entered:
                self.entered.add(k)
                self.events.append({"op": "B", "mb": k})
                rank_timeline.label(f"B{k}")
        return hook

    def _packer(self, k: int):
        def pack(tensor):
            saved = _Saved(tensor)
            self.live[k] = self.live.get(k, 0) + 1
            weakref.finalize(saved, self._released, k)
            self.peak_live = max(self.peak_live, sum(1 for n in self.live.values() if n > 0))
            return saved
        return pack

    def _released(self, k: int) -> None:
        self.live[k] -= 1


@rank_timeline.traced
def pipeline_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        return _observe(ctx)


def _observe(ctx: RankContext) -> dict:
    events: list = []
    steps = []
    rank, world_size, seed = ctx.rank, ctx.world_size, ctx.kwargs["seed"]
    with probes.watch_collectives(events):
        zero_bubble_step = ctx.function("zero_bubble_step")
        for case in ctx.kwargs["cases"]:
            first = len(events)
            stage = ObservedStage(build_stages(seed, world_size)[rank], events).to(ctx.device)
            batch, target = make_batch(seed, case)
            batch = batch.to(ctx.device) if rank == 0 else None
            target = target.to(ctx.device) if rank == world_size - 1 else None
            with rank_timeline.region(region_name(case)):
                returned = zero_bubble_step(stage, batch, target, case["num_microbatches"], loss_fn)
            steps.append({
                "returned": {"type": type(returned).__name__,
                             "value": float(returned) if isinstance(returned, (int, float)) else None},
                "grads": {name: None if p.grad is None else p.grad.detach().cpu().clone()
                          for name, p in stage.body.named_parameters()},
                "events": [dict(e) for e in events[first:] if e.get("op") != "f"],
                "peak_live": stage.peak_live,
            })
            del stage
    return {"steps": steps}
