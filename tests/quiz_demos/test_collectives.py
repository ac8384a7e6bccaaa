"""Topic collectives: what each collective leaves on each rank (three gloo ranks), and the ring
all-reduce's traffic (simulated in this process)."""

from __future__ import annotations

import pytest
import torch

from quiz_demos.world import run_world

WORLD = 3


def collectives_main(ctx) -> dict:
    import torch.distributed as dist

    rank = ctx.rank
    out: dict = {}
    with ctx.group():
        t = torch.tensor([1.0, 10.0]) * (rank + 1)
        out["all_reduce_returns"] = repr(dist.all_reduce(t))
        out["all_reduce"] = t

        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out["avg"] = t

        t = torch.tensor([float(rank + 1)])
        work = dist.all_reduce(t, async_op=True)
        out["async_returns"] = type(work).__name__
        work.wait()
        out["async_after_wait"] = t

        # Rank r holds chunks [r*10 + 0, r*10 + 1, r*10 + 2]; reduce-scatter leaves rank i chunk i summed.
        chunks = [torch.tensor([float(rank * 10 + i)]) for i in range(ctx.world_size)]
        shard = torch.zeros(1)
        dist.reduce_scatter(shard, chunks)
        out["reduce_scatter"] = shard

        gathered = [torch.zeros(1) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, torch.tensor([float(rank)]))
        out["all_gather"] = torch.cat(gathered)

        t = torch.tensor([float(rank + 1)])
        dist.reduce(t, dst=0)
        out["reduce"] = t

        t = torch.tensor([float(rank * 100)])
        out["broadcast_returns"] = repr(dist.broadcast(t, src=1))
        out["broadcast"] = t
    return out


@pytest.fixture(scope="module")
def ranks(session):
    return run_world(session, "quiz_demos.test_collectives:collectives_main", WORLD)


@pytest.mark.slow
def test_all_reduce_sums_in_place_on_every_rank_and_returns_none(ranks):
    for r in ranks:
        assert r["all_reduce_returns"] == "None"
        assert torch.equal(r["all_reduce"], torch.tensor([6.0, 60.0]))  # (1 + 2 + 3) x [1, 10]


@pytest.mark.slow
def test_avg_averages_on_gloo(ranks):
    # ReduceOp's docstring still says AVG is NCCL-only; gloo on torch 2.13 averages.
    for r in ranks:
        assert torch.equal(r["avg"], torch.tensor([2.0]))  # mean of 1, 2, 3


@pytest.mark.slow
def test_async_all_reduce_returns_a_work_handle_and_wait_gives_the_result(ranks):
    for r in ranks:
        assert r["async_returns"] != "NoneType"
        assert torch.equal(r["async_after_wait"], torch.tensor([6.0]))


@pytest.mark.slow
def test_reduce_scatter_leaves_rank_i_the_sum_of_chunk_i(ranks):
    for i, r in enumerate(ranks):
        assert r["reduce_scatter"].item() == sum(rank * 10 + i for rank in range(WORLD))


@pytest.mark.slow
def test_all_gather_concatenates_and_reduce_fills_only_the_destination(ranks):
    for r in ranks:
        assert torch.equal(r["all_gather"], torch.tensor([0.0, 1.0, 2.0]))
    assert ranks[0]["reduce"].item() == 6.0


@pytest.mark.slow
def test_broadcast_overwrites_every_rank_with_the_source_in_place(ranks):
    for r in ranks:
        assert r["broadcast_returns"] == "None"
        assert torch.equal(r["broadcast"], torch.tensor([100.0]))  # rank 1's value


def ring_all_reduce(inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]]:
    """A ring all-reduce of N equal tensors, step by step: the results, the elements each rank
    sent, and what each rank held after the reduce-scatter phase."""
    n = len(inputs)
    chunks = [list(t.clone().chunk(n)) for t in inputs]
    sent = [0] * n
    for step in range(n - 1):  # reduce-scatter: rank r sends chunk (r - step) to rank r + 1, which adds it
        moves = [(r, (r - step) % n) for r in range(n)]
        payloads = [chunks[r][c].clone() for r, c in moves]
        for (r, c), payload in zip(moves, payloads):
            chunks[(r + 1) % n][c] += payload
            sent[r] += payload.numel()
    owned = [chunks[r][(r + 1) % n].clone() for r in range(n)]
    for step in range(n - 1):  # all-gather: rank r passes its finished chunk (r + 1 - step) on
        moves = [(r, (r + 1 - step) % n) for r in range(n)]
        payloads = [chunks[r][c].clone() for r, c in moves]
        for (r, c), payload in zip(moves, payloads):
            chunks[(r + 1) % n][c] = payload
            sent[r] += payload.numel()
    return [torch.cat(c) for c in chunks], sent, owned


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_tensor_per_rank(n):
    size = 8 * n
    inputs = [torch.randn(size) for _ in range(n)]
    results, sent, owned = ring_all_reduce(inputs)
    total = sum(inputs)
    for result in results:
        torch.testing.assert_close(result, total)
    assert sent == [2 * (n - 1) * size // n] * n
    # After the first phase each rank owns one fully reduced chunk: a reduce-scatter.
    for r in range(n):
        torch.testing.assert_close(owned[r], total.chunk(n)[(r + 1) % n])

