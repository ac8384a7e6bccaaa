"""Exercise 13: pipeline_step, a GPipe and a 1F1B schedule over point-to-point messages: the drivers, run in each
rank (the checks that decide: grader/checks/ex13_pipeline.py).

Build the same seeded model on every rank, cut into one stage per rank, and hand rank r its stage wrapped in
:class:`ObservedStage`, which records every forward and backward the stage runs (and on which micro-batch) and
how many micro-batches' saved activations are alive at once. The count comes from
``torch.autograd.graph.saved_tensors_hooks`` installed around the stage's own layers: each tensor autograd
saves for a micro-batch is wrapped, and a micro-batch counts as alive while any of its wrappers is still held
by the graph. Backward frees them, so the count is what the schedule really keeps in memory, however the code
names or stores things. Each step runs under ``probes.watch_collectives``, which records every send and
receive with its peer and size.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from grader.rank import probes, rank_timeline
from grader.rank.child import RankContext


WIDTHS = (40, 64, 96, 80, 72)  # stage r maps WIDTHS[r] features to WIDTHS[r + 1]: every link has its own size
HIDDEN = 48
CLASSES = 10
MODEL_SEED = 13
DATA_SEED = 1300


def build_stages(world_size: int) -> list[nn.Module]:
    """The model, one stage per rank: two linear layers each, the last one ending in CLASSES logits."""
    torch.manual_seed(MODEL_SEED + world_size)
    stages = []
    for r in range(world_size):
        if r < world_size - 1:
            stages.append(nn.Sequential(nn.Linear(WIDTHS[r], HIDDEN), nn.Tanh(),
                                        nn.Linear(HIDDEN, WIDTHS[r + 1]), nn.Tanh()))
        else:
            stages.append(nn.Sequential(nn.Linear(WIDTHS[r], HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)))
    return stages


def make_batch(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    rows = case["num_microbatches"] * case["rows"]
    g = torch.Generator().manual_seed(DATA_SEED + case["seed"])
    return torch.randn(rows, WIDTHS[0], generator=g), torch.randint(0, CLASSES, (rows,), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)


def cases_for(schedule: str, world_size: int) -> list[dict]:
    """The steps of one run. The first (``measure``) has more micro-batches than ranks, where the
    schedules differ; the second another micro-batch size (1f1b keeps num_microbatches >= W)."""
    w = max(world_size, 1)
    second = w if schedule == "1f1b" else 3
    return [
        {"schedule": schedule, "num_microbatches": 2 * w, "rows": 4, "measure": True, "seed": 10 * w + 1},
        {"schedule": schedule, "num_microbatches": second, "rows": 3, "measure": False, "seed": 10 * w + 2},
    ]


def region_name(case: dict) -> str:
    """What the timeline calls the measured step of a run."""
    return f"the step of {case['num_microbatches']} micro-batches"


def activation_bytes(case: dict, link: int) -> int:
    """Bytes of one micro-batch's activation from stage ``link`` to stage ``link + 1`` (and of its gradient)."""
    return case["rows"] * WIDTHS[link + 1] * 4


class _Saved:
    """What autograd keeps for a saved tensor while the stage's forward runs under our hooks."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class ObservedStage(nn.Module):
    """The learner's stage: its layers in ``body``, each forward and backward recorded.

    The k-th forward with gradients enabled is micro-batch k: it records ("F", k, rows), and the
    gradient reaching its output records ("B", k) when that micro-batch's backward enters the
    stage. A forward under torch.no_grad (e.g. to learn the output's shape) saves nothing for
    backward and is not part of the schedule: it is recorded as "f" and left out of every check.
    """

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.observed: list[dict] = []
        self.live: dict[int, int] = {}  # micro-batch -> its saved tensors still held by autograd
        self.peak_live = 0  # the most micro-batches with saved tensors alive at one moment

    def forward(self, x):
        rows = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else 0
        if not torch.is_grad_enabled():
            self.observed.append({"op": "f", "mb": -1, "rows": rows})
            return self.body(x)
        k = sum(1 for e in self.observed if e["op"] == "F")
        self.observed.append({"op": "F", "mb": k, "rows": rows})
        rank_timeline.label(f"F{k}")
        with torch.autograd.graph.saved_tensors_hooks(self._packer(k), _unpack):
            out = self.body(x)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._backward_hook(k))
        return out

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

    def _backward_hook(self, k: int):
        def hook(grad):
            self.observed.append({"op": "B", "mb": k, "rows": 0})
            rank_timeline.label(f"B{k}")
        return hook


def _unpack(saved: _Saved):
    return saved.tensor


@rank_timeline.traced
def pipeline_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        return _observe(ctx)


def _observe(ctx: RankContext) -> dict:
    events: list = []
    steps = []
    rank, world_size = ctx.rank, ctx.world_size
    with probes.watch_collectives(events):
        pipeline_step = ctx.function("pipeline_step")
        for case in ctx.kwargs["cases"]:
            stage = ObservedStage(build_stages(world_size)[rank]).to(ctx.device)
            batch, target = make_batch(case)
            batch = batch.to(ctx.device) if rank == 0 else None
            target = target.to(ctx.device) if rank == world_size - 1 else None
            first = len(events)
            with rank_timeline.region(region_name(case)) if case["measure"] else contextlib.nullcontext():
                if case["schedule"] == "gpipe":  # the default schedule
                    returned = pipeline_step(stage, batch, target, case["num_microbatches"], loss_fn)
                else:
                    returned = pipeline_step(stage, batch, target, case["num_microbatches"], loss_fn,
                                             schedule=case["schedule"])
            steps.append({
                "returned": {"type": type(returned).__name__,
                             "value": float(returned) if isinstance(returned, (int, float)) else None},
                "grads": {name: None if p.grad is None else p.grad.detach().cpu().clone()
                          for name, p in stage.body.named_parameters()},
                "observed": [e for e in stage.observed if e["op"] != "f"],
                "peak_live": stage.peak_live,
                "events": [dict(e) for e in events[first:]],
            })
    return {"steps": steps}
