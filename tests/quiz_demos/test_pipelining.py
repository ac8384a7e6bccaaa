"""Topic pipeline-parallel, the API of torch.distributed.pipelining: which stages a rank holds under the
interleaved schedule, the losses a step hands back on the last stage, and how ScheduleLoopedBFS orders
two stages per rank. Two gloo ranks on CPU, one run through the grader's harness for the whole module;
each schedule runs two steps and the second is recorded (the first also infers the stages' shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quiz_demos.world import run_world

WORLD = 2
MICROBATCHES = 4
ROWS = 3  # per micro-batch
WIDTH = 8


def build_blocks(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(MICROBATCHES * ROWS, WIDTH, generator=g), torch.randn(MICROBATCHES * ROWS, WIDTH, generator=g)


class Recorder(nn.Module):
    """One stage's block; appends (stage, "F") to ``log`` per forward with gradients, and (stage, "B") when
    the gradient reaches its output; counts the micro-batches whose output still waits for its backward."""

    def __init__(self, body: nn.Module, stage: int, log: list, live: list):
        super().__init__()
        self.body, self.stage, self.log, self.live = body, stage, log, live

    def forward(self, x):
        if not torch.is_grad_enabled() or x.device.type == "meta":
            return self.body(x)
        self.log.append((self.stage, "F"))
        self.live[0] += 1
        self.live[1] = max(self.live[1], self.live[0])
        out = self.body(x)
        out.register_hook(lambda grad: self._backward())
        return out

    def _backward(self):
        self.log.append((self.stage, "B"))
        self.live[0] -= 1


def pipelining_main(ctx) -> dict:
    with ctx.group():
        out = _observe(ctx.rank)
        import torch.distributed as dist

        dist.barrier()
    return out


def _observe(rank: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS

    x, y = batch()
    out = {}
    for name, schedule_class in (("interleaved", ScheduleInterleaved1F1B), ("looped_bfs", ScheduleLoopedBFS)):
        log, live = [], [0, 0]
        num_stages = 2 * WORLD
        blocks = build_blocks(num_stages)
        mine = list(range(rank, num_stages, WORLD))  # torch's default placement for several stages per rank
        stages = [PipelineStage(Recorder(blocks[s], s, log, live), s, num_stages, torch.device("cpu")) for s in mine]
        schedule = schedule_class(stages, MICROBATCHES, loss_fn=F.mse_loss)
        for _ in range(2):
            log.clear()
            live[:] = [0, 0]
            losses = []
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
        out[name] = {"stages": mine, "log": log, "peak": live[1]}

    blocks = build_blocks(WORLD)
    schedule = ScheduleGPipe(PipelineStage(blocks[rank], rank, WORLD, torch.device("cpu")), MICROBATCHES,
                             loss_fn=F.mse_loss)
    for _ in range(2):
        losses = []
        returned = schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
    out["gpipe"] = {"losses": [float(v) for v in losses], "returned": type(returned).__name__}
    return out


@pytest.fixture(scope="module")
def ranks(session):
    return run_world(session, "quiz_demos.test_pipelining:pipelining_main", WORLD)


@pytest.mark.slow
def test_interleaved_rank_r_runs_stages_r_and_r_plus_w(ranks):
    for rank, r in enumerate(ranks):
        ran = sorted({stage for stage, op in r["interleaved"]["log"]})
        assert ran == [rank, rank + WORLD]


@pytest.mark.slow
def test_losses_fill_the_list_on_the_last_stage_one_per_micro_batch(ranks):
    assert len(ranks[-1]["gpipe"]["losses"]) == MICROBATCHES
    assert ranks[-1]["gpipe"]["returned"] == "Tensor" and ranks[0]["gpipe"]["returned"] == "NoneType"


@pytest.mark.slow
def test_the_mean_of_the_micro_batch_losses_is_the_whole_batch_loss(ranks):
    blocks = build_blocks(WORLD)
    x, y = batch()
    whole = F.mse_loss(nn.Sequential(*blocks)(x), y).item()
    losses = ranks[-1]["gpipe"]["losses"]
    assert sum(losses) / len(losses) == pytest.approx(whole, rel=1e-6)
    assert sum(losses) == pytest.approx(MICROBATCHES * whole, rel=1e-6)


@pytest.mark.slow
def test_looped_bfs_finishes_one_stage_before_the_next_and_holds_more(ranks):
    for rank, r in enumerate(ranks):
        first, second = r["looped_bfs"]["stages"]
        forwards = [stage for stage, op in r["looped_bfs"]["log"] if op == "F"]
        assert forwards == [first] * MICROBATCHES + [second] * MICROBATCHES
        interleaved = [stage for stage, op in r["interleaved"]["log"] if op == "F"]
        assert interleaved.index(second) < max(i for i, s in enumerate(interleaved) if s == first)
    assert ranks[0]["looped_bfs"]["peak"] == 2 * MICROBATCHES
    assert ranks[0]["interleaved"]["peak"] < ranks[0]["looped_bfs"]["peak"]
