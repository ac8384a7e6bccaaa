"""Topic pipeline-parallel: torch.distributed.pipelining's own GPipe and 1F1B schedules, run by two
gloo ranks on CPU (one run through the grader's harness for the whole module), with every forward
and backward of each stage, the micro-batches' saved activations alive at once, and the messages
each rank sent recorded.
Each schedule runs two steps and the second is recorded: the first also runs a forward of its own
to infer the shapes that the stages exchange."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from quiz_demos.world import run_world

WORLD = 2
MICROBATCHES = 4
ROWS = 3  # per micro-batch
WIDTH = 16  # of the activation between the two stages


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def stage_module(rank: int) -> nn.Module:
    model = build_model()
    return model[:2] if rank == 0 else model[2:]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(MICROBATCHES * ROWS, 8, generator=g), torch.randn(MICROBATCHES * ROWS, 4, generator=g)


class Recorder(nn.Module):
    """A stage's layers; records "F<i>" per forward with gradients, "B<i>" when its backward reaches the
    output, and the most micro-batches whose saved tensors (saved_tensors_hooks) are alive at once."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.order: list[str] = []
        self.live: dict[int, int] = {}
        self.peak = 0

    def forward(self, x):
        if not torch.is_grad_enabled() or x.device.type == "meta":
            return self.body(x)
        k = sum(1 for label in self.order if label[0] == "F")
        self.order.append(f"F{k}")

        class Saved:
            def __init__(self, t):
                self.t = t

        def pack(t):
            import weakref

            saved = Saved(t)
            self.live[k] = self.live.get(k, 0) + 1
            weakref.finalize(saved, self._release, k)
            self.peak = max(self.peak, sum(1 for n in self.live.values() if n))
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.t):
            out = self.body(x)
        out.register_hook(lambda grad: self.order.append(f"B{k}"))
        return out

    def _release(self, k):
        self.live[k] -= 1


def _sends(events: list) -> list[tuple[int, int]]:
    return [(e["peer"], e["bytes"]) for e in events if e["op"] in ("send", "isend")]


def pipeline_main(ctx) -> dict:
    with ctx.group():
        out = _observe(ctx.rank)
        dist.barrier()
    return out


def _observe(rank: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from grader.rank import probes

    x, y = batch()
    out = {}
    for name, schedule_class in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        module = Recorder(copy.deepcopy(stage_module(rank)))
        stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))
        schedule = schedule_class(stage, MICROBATCHES, loss_fn=nn.functional.mse_loss)
        for _ in range(2):  # the first step also infers the shapes, with a forward of its own
            module.zero_grad(set_to_none=True)
            module.order, module.live, module.peak = [], {}, 0
            events: list = []
            with probes.watch_collectives(events):
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y)
        out[name] = {"order": module.order, "peak": module.peak, "sends": _sends(events),
                     "grads": {n: p.grad.clone() for n, p in module.body.named_parameters()},
                     "parameter_bytes": sorted({p.numel() * p.element_size() for p in module.parameters()})}
    return out


@pytest.fixture(scope="module")
def ranks(session):
    return run_world(session, "quiz_demos.test_pipeline_parallel:pipeline_main", WORLD)


def unit_time_idle(orders: list[list[str]]) -> float:
    """Place each rank's order in unit time slots (F k after F k on the rank before, B k after B k on
    the rank after, or after F k on the last rank) and return the idle share of ranks x slots."""
    slot: dict[tuple[int, str], int] = {}
    done = [0] * len(orders)
    last = len(orders) - 1
    while any(done[r] < len(o) for r, o in enumerate(orders)):
        moved = False
        for r, order in enumerate(orders):
            while done[r] < len(order):
                label = order[done[r]]
                dep = ((r - 1, label) if r > 0 else None) if label[0] == "F" else \
                    ((r + 1, label) if r < last else (r, "F" + label[1:]))
                if dep is not None and dep not in slot:
                    break
                start = max(slot[(r, order[done[r] - 1])] + 1 if done[r] else 0, slot[dep] + 1 if dep else 0)
                slot[(r, label)] = start
                done[r] += 1
                moved = True
        assert moved, "the orders wait for each other"
    span = 1 + max(slot.values())
    busy = sum(len(o) for o in orders)
    return 1 - busy / (span * len(orders))


@pytest.mark.slow
def test_gpipe_runs_every_forward_then_every_backward(ranks):
    m = MICROBATCHES
    for r in ranks:
        assert r["gpipe"]["order"] == [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]


@pytest.mark.slow
def test_1f1b_stage_s_runs_w_minus_s_forwards_before_its_first_backward(ranks):
    for s, r in enumerate(ranks):
        order = r["1f1b"]["order"]
        assert order.index("B0") == min(MICROBATCHES, WORLD - s)
    assert ranks[0]["1f1b"]["order"] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]


@pytest.mark.slow
def test_1f1b_holds_at_most_w_micro_batches_gpipe_holds_all(ranks):
    assert [r["gpipe"]["peak"] for r in ranks] == [MICROBATCHES, MICROBATCHES]
    assert [r["1f1b"]["peak"] for r in ranks] == [WORLD - s for s in range(WORLD)]


@pytest.mark.slow
def test_the_bubble_is_w_minus_1_over_m_plus_w_minus_1_for_both_schedules(ranks):
    expected = (WORLD - 1) / (MICROBATCHES + WORLD - 1)
    for name in ("gpipe", "1f1b"):
        assert unit_time_idle([r[name]["order"] for r in ranks]) == pytest.approx(expected)


@pytest.mark.slow
def test_only_activations_and_their_gradients_cross_the_link(ranks):
    activation = ROWS * WIDTH * 4
    for name in ("gpipe", "1f1b"):
        forward = [b for peer, b in ranks[0][name]["sends"] if peer == 1]
        backward = [b for peer, b in ranks[1][name]["sends"] if peer == 0]
        assert forward.count(activation) == MICROBATCHES and backward.count(activation) == MICROBATCHES
        parameter_sizes = set(ranks[0][name]["parameter_bytes"]) | set(ranks[1][name]["parameter_bytes"])
        assert not parameter_sizes & set(forward + backward)


@pytest.mark.slow
def test_default_scale_grads_gives_the_gradient_of_the_whole_batch_mean_loss(ranks):
    model = build_model()
    x, y = batch()
    nn.functional.mse_loss(model(x), y).backward()
    expected = [{n: p.grad for n, p in stage.named_parameters()} for stage in (model[:2], model[2:])]
    for name in ("gpipe", "1f1b"):
        for s, r in enumerate(ranks):
            for key, grad in r[name]["grads"].items():
                torch.testing.assert_close(grad, expected[s][key], rtol=1e-5, atol=1e-6)


def test_interleaved_1f1b_is_a_multi_stage_schedule_and_1f1b_is_not():
    from torch.distributed.pipelining.schedules import (PipelineScheduleMulti, PipelineScheduleSingle, Schedule1F1B,
                                                        ScheduleGPipe, ScheduleInterleaved1F1B)

    assert issubclass(ScheduleInterleaved1F1B, PipelineScheduleMulti)
    assert all(issubclass(c, PipelineScheduleSingle) and not issubclass(c, PipelineScheduleMulti)
               for c in (ScheduleGPipe, Schedule1F1B))
