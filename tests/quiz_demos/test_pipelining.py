"""Topic pipeline-parallel, the API of torch.distributed.pipelining: which stages a rank holds under the
interleaved schedule, the losses a step hands back on the last stage, how ScheduleLoopedBFS orders
two stages per rank, and what interleaving costs and saves against Schedule1F1B over the same four
blocks (the idle time of orders played in unit costs, the messages sent). Two gloo ranks on CPU, one
run through the grader's harness for the whole module; each schedule runs two steps and the second is
recorded (the first also infers the stages' shapes)."""

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
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleLoopedBFS)

    from grader.rank import probes

    x, y = batch()
    out = {}
    num_stages = 2 * WORLD
    for name, schedule_class in (("interleaved", ScheduleInterleaved1F1B), ("looped_bfs", ScheduleLoopedBFS),
                                 ("1f1b", Schedule1F1B)):
        log, live = [], [0, 0]
        blocks = build_blocks(num_stages)
        if schedule_class is Schedule1F1B:  # the same four blocks, two contiguous ones per rank
            mine = [rank]
            stages = PipelineStage(Recorder(nn.Sequential(*blocks[2 * rank:2 * rank + 2]), rank, log, live), rank,
                                   WORLD, torch.device("cpu"))
        else:
            mine = list(range(rank, num_stages, WORLD))  # torch's default placement for several stages per rank
            stages = [PipelineStage(Recorder(blocks[s], s, log, live), s, num_stages, torch.device("cpu"))
                      for s in mine]
        schedule = schedule_class(stages, MICROBATCHES, loss_fn=F.mse_loss)
        for _ in range(2):
            log.clear()
            live[:] = [0, 0]
            losses, events = [], []
            with probes.watch_collectives(events):
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=losses)
        sends = sum(1 for e in events if e["op"] in ("send", "isend"))
        out[name] = {"stages": mine, "log": log, "peak": live[1], "sends": sends}

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


def idle_time(orders: list[list[tuple[int, str]]], num_stages: int, cost: int) -> int:
    """Play each rank's (stage, "F"/"B") order in unit time, every operation taking ``cost`` units: the
    k-th forward of stage s after the k-th of stage s - 1, its backward after the next stage's (after its
    own forward on the last stage). The idle units of one rank (all ranks idle alike)."""
    done: dict[tuple[int, str, int], int] = {}
    ops = []
    for order in orders:
        seen: dict[tuple[int, str], int] = {}
        ops.append([])
        for stage, kind in order:
            k = seen.get((stage, kind), 0)
            seen[(stage, kind)] = k + 1
            ops[-1].append((stage, kind, k))
    clock, position = [0] * len(ops), [0] * len(ops)
    while any(position[r] < len(o) for r, o in enumerate(ops)):
        moved = False
        for r, order in enumerate(ops):
            while position[r] < len(order):
                stage, kind, k = order[position[r]]
                if kind == "F":
                    after = (stage - 1, "F", k) if stage > 0 else None
                else:
                    after = (stage + 1, "B", k) if stage < num_stages - 1 else (stage, "F", k)
                if after is not None and after not in done:
                    break
                clock[r] = max(clock[r], done[after] if after else 0) + cost
                done[(stage, kind, k)] = clock[r]
                position[r] += 1
                moved = True
        assert moved, "the orders wait for each other"
    span = max(done.values())
    idle = {span - cost * len(order) for order in ops}
    assert len(idle) == 1
    return idle.pop()


@pytest.mark.slow
def test_interleaving_divides_the_idle_time_by_v_and_multiplies_the_rank_crossings(ranks):
    v = 2  # stages per rank; a 1F1B stage is v blocks, so each of its operations costs v units
    for r in ranks:
        assert sorted({stage for stage, _ in r["interleaved"]["log"]}) == r["interleaved"]["stages"]
    interleaved = idle_time([r["interleaved"]["log"] for r in ranks], v * WORLD, cost=1)
    one_f_one_b = idle_time([r["1f1b"]["log"] for r in ranks], WORLD, cost=v)
    assert (interleaved, one_f_one_b) == (2, 4)  # 1/v of the idle time
    # Each micro-batch crosses vW - 1 = 3 rank boundaries each way instead of W - 1 = 1.
    assert sum(r["interleaved"]["sends"] for r in ranks) == 2 * MICROBATCHES * (v * WORLD - 1) == 24
    assert sum(r["1f1b"]["sends"] for r in ranks) == 2 * MICROBATCHES * (WORLD - 1) == 8


@pytest.mark.slow
def test_looped_bfs_finishes_one_stage_before_the_next_and_holds_more(ranks):
    for rank, r in enumerate(ranks):
        first, second = r["looped_bfs"]["stages"]
        forwards = [stage for stage, op in r["looped_bfs"]["log"] if op == "F"]
        assert forwards == [first] * MICROBATCHES + [second] * MICROBATCHES
        interleaved = [stage for stage, op in r["interleaved"]["log"] if op == "F"]
        assert interleaved.index(second) < max(i for i, s in enumerate(interleaved) if s == first)
    assert ranks[0]["looped_bfs"]["peak"] == 2 * MICROBATCHES
    assert ranks[0]["interleaved"]["peak"] == 5 < ranks[0]["looped_bfs"]["peak"]  # M = 2W: the peaks differ
