"""Demonstrations for the Ulysses quiz topic, run on the installed torch.

Arithmetic on one process: DeepSpeed's copies of key/value heads when there are fewer than ranks (the
exchange simulated by slicing), which degrees the heads allow, and the causal work of each rank under
Ulysses and under a contiguous ring. One world of four gloo ranks (run once for the module, through the
grader's harness) runs Ulysses with dist.all_to_all and a ring of point-to-point K/V hops, counting the
bytes each rank sends, checks the backward of the functional all_to_all_single, and fills a receive buffer
made by torch.empty_like of a permuted view.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from quiz_demos.world import run_world

WORLD = 4
B, CHUNK, D = 1, 2, 4


def inputs(heads: int, kv_heads: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, length, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv_heads, length, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def test_deepspeed_copies_each_key_value_head_so_every_rank_receives_the_one_it_needs():
    """32 query heads, 4 key/value heads, 8 ranks: repeat_interleave by 8 / 4 = 2, then cut the heads into
    8 parts as the all-to-all does; rank r's four query heads attend with the one key/value head it got."""
    heads, kv_heads, world, length = 32, 4, 8, 6
    q, k, v = inputs(heads, kv_heads, length, seed=1)
    dense = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    copies = world // kv_heads
    k_copied, v_copied = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    per_rank = heads // world
    for rank in range(world):
        k_mine, v_mine = k_copied[:, rank:rank + 1], v_copied[:, rank:rank + 1]  # part r of 8 one-head parts
        assert torch.equal(k_mine, k[:, rank // copies:rank // copies + 1])
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        local = F.scaled_dot_product_attention(q[:, mine], k_mine, v_mine, enable_gqa=True)
        assert torch.allclose(local, dense[:, mine], atol=1e-12)
    # repeat (not repeat_interleave) lays the copies out 0, 1, 2, 3, 0, 1, ...: rank 1 would get head 1.
    assert torch.equal(k.repeat(1, copies, 1, 1)[:, 1], k[:, 1]) and not torch.equal(k[:, 1], k[:, 0])


def test_the_heads_bound_the_degree():
    """The exchange cuts the heads into [W, heads / W]: W must divide them, and W > heads leaves no head."""
    heads = 32
    x = torch.zeros(1, heads, 2, 4)
    for world in (8, 16):
        assert x.reshape(1, world, heads // world, 2, 4).shape[2] == heads // world
    for world in (24, 64):
        with pytest.raises(RuntimeError):
            x.reshape(1, world, heads // world, 2, 4)


def test_causal_work_is_even_under_ulysses_and_not_over_a_contiguous_ring():
    """Query-key pairs inside the causal mask, per rank, for 4 ranks, 8 heads and 16 positions."""
    world, heads, length = 4, 8, 16
    allowed = torch.ones(length, length, dtype=torch.bool).tril()
    ulysses = [heads // world * int(allowed.sum()) for _ in range(world)]  # its heads over the whole sequence
    chunk = length // world
    ring = [heads * int(allowed[r * chunk:(r + 1) * chunk].sum()) for r in range(world)]  # its queries, every head
    assert ulysses == [272] * world and sum(ulysses) == sum(ring)
    assert ring == [80, 208, 336, 464]


def test_a_longer_chunk_multiplies_a_rings_block_compute_by_4_and_its_hop_by_2():
    """One head's block attention (q k^T, softmax, p v) at n and 2n positions: FLOPs counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    found = []
    for n in (64, 128):
        q, k, v = (torch.randn(1, 1, n, 16) for _ in range(3))
        with FlopCounterMode(display=False) as counter:
            (q @ k.transpose(-2, -1) / 4).softmax(dim=-1) @ v
        found.append((counter.get_total_flops(), (k.numel() + v.numel()) * k.element_size()))
    (flops, hop), (flops_2n, hop_2n) = found
    assert flops_2n == 4 * flops and hop_2n == 2 * hop


def _cross_node_bytes_of_an_exchange(parts_bytes: list[int], rank: int, per_node: int) -> int:
    """Bytes of an all-to-all's parts (part j to rank j) that go to ranks on another node."""
    return sum(b for j, b in enumerate(parts_bytes) if j // per_node != rank // per_node)


def test_across_two_nodes_usp_sends_a_third_of_ulysses_bytes_between_them_with_gqa():
    """32 query heads, 8 key/value heads, 16 ranks in two nodes of 8; q's chunk on a rank is 1 unit
    (a position's head row being the unit's 1 / (32 x positions per rank))."""
    heads, kv_heads, world, per_node, positions = 32, 8, 16, 8, 2  # positions per rank
    row = 1  # bytes of one head's row at one position, in units
    q_chunk = heads * positions * row
    rank = 0
    # Ulysses over all 16: q and the output 32 heads; k and v copied to 16 heads (8 < 16), one to each rank.
    part = lambda heads_sent: [heads_sent // world * positions * row] * world  # noqa: E731
    ulysses = sum(_cross_node_bytes_of_an_exchange(part(h), rank, per_node) for h in (heads, 16, 16, heads))
    # USP: Ulysses over the 8 ranks of a node (never crossing), then a ring of 2 across the nodes: one hop of
    # this rank's K and V, 8 / 8 = 1 key/value head over the node's 8 chunks of positions.
    usp = 2 * (kv_heads // per_node) * (per_node * positions) * row
    assert (ulysses / q_chunk, usp / q_chunk) == (1.5, 0.5)
    # With as many key/value heads as query heads the two send the same bytes across (2 query chunks).
    ulysses_mha = sum(_cross_node_bytes_of_an_exchange(part(heads), rank, per_node) for _ in range(4))
    usp_mha = 2 * (heads // per_node) * (per_node * positions) * row
    assert ulysses_mha == usp_mha == 2 * q_chunk


# --- one world of four ranks ----------------------------------------------------------------------


def _exchange(x, dist, rank: int, world: int, dim_split: int, dim_join: int) -> tuple[torch.Tensor, int]:
    """Cut x along dim_split into W parts, send part j to rank j (dist.all_to_all), join what arrives along
    dim_join in rank order. Returns the result and the bytes this rank sent to other ranks."""
    parts = [p.contiguous() for p in x.chunk(world, dim=dim_split)]
    received = [torch.empty_like(parts[rank]) for _ in range(world)]
    dist.all_to_all(received, parts)
    sent = sum(p.numel() * p.element_size() for j, p in enumerate(parts) if j != rank)
    return torch.cat(received, dim=dim_join), sent


def _ulysses(dist, rank: int, q, k, v, causal: bool = False) -> tuple[torch.Tensor, int]:
    """This rank's chunk of attention, by Ulysses, and the bytes it sent (kv_heads divisible by W)."""
    sent = 0
    moved = []
    for t in (q, k, v):
        t, n = _exchange(t, dist, rank, WORLD, dim_split=1, dim_join=2)  # sequence-sharded -> head-sharded
        moved.append(t)
        sent += n
    out = F.scaled_dot_product_attention(*moved, is_causal=causal, enable_gqa=True)
    out, n = _exchange(out, dist, rank, WORLD, dim_split=2, dim_join=1)  # head-sharded -> sequence-sharded
    return out, sent + n


def _ring_bytes(dist, rank: int, k, v) -> int:
    """K and V blocks passed to the next rank W - 1 times: the bytes this rank sends."""
    sent = 0
    block_k, block_v = k.contiguous(), v.contiguous()
    for _ in range(WORLD - 1):
        incoming = [torch.empty_like(block_k), torch.empty_like(block_v)]
        requests = [dist.isend(block_k, (rank + 1) % WORLD), dist.isend(block_v, (rank + 1) % WORLD),
                    dist.irecv(incoming[0], (rank - 1) % WORLD), dist.irecv(incoming[1], (rank - 1) % WORLD)]
        sent += sum(t.numel() * t.element_size() for t in (block_k, block_v))
        for request in requests:
            request.wait()
        block_k, block_v = incoming
    return sent


def _observe(rank: int) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    obs = {}
    mine = slice(rank * CHUNK, (rank + 1) * CHUNK)

    # Multi-head attention: Ulysses' bytes against a ring's, and the exact answer.
    q, k, v = inputs(WORLD, WORLD, WORLD * CHUNK, seed=2)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out, sent = _ulysses(dist, rank, q[:, :, mine], k[:, :, mine], v[:, :, mine], causal=True)
    obs["mha"] = {"error": float((out - whole[:, :, mine]).abs().max()), "ulysses_bytes": sent,
                  "chunk_bytes": q[:, :, mine].numel() * 8, "ring_bytes": _ring_bytes(dist, rank, k[:, :, mine],
                                                                                     v[:, :, mine])}

    # Grouped-query attention, 16 query heads and 4 key/value heads (32 and 8 scaled down).
    q, k, v = inputs(16, 4, WORLD * CHUNK, seed=3)
    whole = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    out, sent = _ulysses(dist, rank, q[:, :, mine], k[:, :, mine], v[:, :, mine])
    obs["gqa"] = {"error": float((out - whole[:, :, mine]).abs().max()), "ulysses_bytes": sent,
                  "q_chunk_bytes": q[:, :, mine].numel() * 8,
                  "ring_bytes": _ring_bytes(dist, rank, k[:, :, mine], v[:, :, mine])}

    # The backward of the functional all_to_all_single: the same exchange with the split sizes swapped.
    splits_out = [rank + 1] * WORLD  # rank r receives r + 1 rows from every rank
    splits_in = [j + 1 for j in range(WORLD)]  # and sends j + 1 rows to rank j
    x = torch.randn(sum(splits_in), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank),
                    requires_grad=True)
    y = funcol.wait_tensor(funcol.all_to_all_single(x, splits_out, splits_in, dist.group.WORLD))
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
    (y * g).sum().backward()
    back = torch.empty_like(x)
    dist.all_to_all_single(back, g, output_split_sizes=splits_in, input_split_sizes=splits_out)
    obs["backward_is_the_opposite_exchange"] = bool(torch.equal(x.grad, back))

    # A receive buffer made by empty_like of a permuted view keeps the view's strides.
    x0 = torch.arange(WORLD * 6, dtype=torch.float64).reshape(WORLD, 2, 3) + 100 * rank
    view = x0.permute(0, 2, 1)
    out = torch.empty_like(view)
    dist.all_to_all_single(out, view.contiguous())
    right = torch.empty(view.shape, dtype=view.dtype)
    dist.all_to_all_single(right, view.contiguous())
    obs["empty_like"] = {"contiguous": out.is_contiguous(), "equal": bool(torch.equal(out, right)),
                         "same_values": bool(torch.equal(out.flatten().sort().values, right.flatten().sort().values))}
    return obs


def observe_main(ctx) -> dict:
    with ctx.group():
        return _observe(ctx.rank)


@pytest.fixture(scope="module")
def observed(session) -> list[dict]:
    return run_world(session, "quiz_demos.test_ulysses:observe_main", WORLD)


@pytest.mark.slow
def test_ulysses_forward_sends_w_minus_1_over_w_of_four_chunks(observed):
    for obs in observed:
        mha = obs["mha"]
        assert mha["error"] < 1e-12
        assert mha["ulysses_bytes"] == 4 * mha["chunk_bytes"] * (WORLD - 1) // WORLD


@pytest.mark.slow
def test_a_ring_sends_w_over_2_times_ulysses_bytes_with_multi_head_attention(observed):
    for obs in observed:
        mha = obs["mha"]
        assert mha["ring_bytes"] == 2 * (WORLD - 1) * mha["chunk_bytes"]
        assert mha["ring_bytes"] == WORLD // 2 * mha["ulysses_bytes"]
    # The same formulas on 8 ranks: 2 x 7 blocks against 4 x 7 / 8, four times as many.
    assert math.isclose((2 * 7) / (4 * 7 / 8), 4)


@pytest.mark.slow
def test_with_a_quarter_as_many_key_value_heads_a_ring_of_four_sends_less_than_ulysses(observed):
    for obs in observed:
        gqa = obs["gqa"]
        assert gqa["error"] < 1e-12
        assert gqa["ring_bytes"] == 1.5 * gqa["q_chunk_bytes"]
        assert gqa["ulysses_bytes"] == 1.875 * gqa["q_chunk_bytes"]
    # The same formulas on 8 ranks: the ring's hops catch up (3.5 query chunks against 2.1875).
    assert (2 * 7 * 0.25, 7 / 8 * (1 + 0.25 + 0.25 + 1)) == (3.5, 2.1875)


@pytest.mark.slow
def test_the_backward_of_all_to_all_single_is_the_exchange_with_splits_swapped(observed):
    assert all(obs["backward_is_the_opposite_exchange"] for obs in observed)


@pytest.mark.slow
def test_a_receive_buffer_from_empty_like_of_a_view_comes_back_scrambled(observed):
    for obs in observed:
        got = obs["empty_like"]
        assert not got["contiguous"] and not got["equal"] and got["same_values"]
