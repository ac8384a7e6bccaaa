"""Demonstrations for the sequence-parallel quiz topic, run on the installed torch.

Most claims are arithmetic in one process, with the W ranks of a sequence-parallel block played
one after the other: a LayerNorm run on chunks of the sequence (its parameters' gradients per chunk,
what autograd saves), the gradient of an all-gather in front of a column-parallel layer, fc2's bias
added before or after a reduce-scatter, a weight gradient from the whole input or from a chunk, the
bytes of ring collectives, and dropout masks drawn per chunk. One world of three gloo ranks (run once
for the module, through the grader's harness) runs the backward of torch's differentiable
_functional_collectives.all_gather_tensor_autograd.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quiz_demos.world import run_world

WORLD = 3
SEQ, BATCH, D, HIDDEN = 6, 2, 4, 6


def dense_modules(seed: int = 0):
    torch.manual_seed(seed)
    norm = torch.nn.LayerNorm(D, dtype=torch.float64)
    fc1 = torch.nn.Linear(D, HIDDEN, dtype=torch.float64)
    fc2 = torch.nn.Linear(HIDDEN, D, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.add_(torch.randn(D, dtype=torch.float64))
        norm.bias.add_(torch.randn(D, dtype=torch.float64))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(SEQ, BATCH, D, generator=g, dtype=torch.float64)
    grad_out = torch.randn(SEQ, BATCH, D, generator=g, dtype=torch.float64)
    return norm, fc1, fc2, x, grad_out


def block(norm, fc1, fc2, x):
    return x + fc2(F.gelu(fc1(norm(x))))


def norm_grads_per_chunk(world: int):
    """The LayerNorm's weight gradient on each of ``world`` ranks, each running the block on its chunk (with
    the whole hidden layer, so that only the sequence is split), and the dense gradient."""
    norm, fc1, fc2, x, grad_out = dense_modules()
    (block(norm, fc1, fc2, x) * grad_out).sum().backward()
    dense = norm.weight.grad.clone()
    per_rank = []
    for x_chunk, g_chunk in zip(x.chunk(world), grad_out.chunk(world)):
        norm.weight.grad = None
        (block(norm, fc1, fc2, x_chunk) * g_chunk).sum().backward()
        per_rank.append(norm.weight.grad.clone())
    return dense, per_rank


def test_each_rank_holds_its_chunks_share_of_the_norm_gradient_and_their_sum_is_the_dense_one():
    dense, per_rank = norm_grads_per_chunk(WORLD)
    assert torch.allclose(sum(per_rank), dense, atol=1e-12)
    assert all(not torch.allclose(g, dense, atol=1e-3) for g in per_rank)
    assert not torch.allclose(sum(per_rank) / WORLD, dense, atol=1e-3)  # averaging, as DDP does, is not it


def test_replicas_updated_with_their_own_gradients_drift_apart():
    _, per_rank = norm_grads_per_chunk(WORLD)
    weight = torch.ones(D, dtype=torch.float64)
    stepped = [weight - 0.1 * g for g in per_rank]  # one SGD step per rank, no all-reduce
    assert not torch.allclose(stepped[0], stepped[1])
    summed = sum(per_rank)
    assert all(torch.equal(weight - 0.1 * summed, weight - 0.1 * summed) for _ in per_rank)


def test_the_all_gathers_backward_is_a_reduce_scatter_of_the_ranks_partial_gradients():
    """Rank r multiplies the gathered sequence by its hidden block: its gradient of the gathered sequence is one
    term; the dense gradient of a chunk is the sum of the terms' rows, not one rank's own rows."""
    norm, fc1, fc2, x, grad_out = dense_modules(2)
    normed = norm(x).detach().requires_grad_(True)
    (fc2(F.gelu(fc1(normed))) * grad_out).sum().backward()
    dense = normed.grad
    width = HIDDEN // WORLD
    terms = []
    for r in range(WORLD):
        rows = slice(r * width, (r + 1) * width)
        gathered = norm(x).detach().requires_grad_(True)
        partial = F.linear(F.gelu(F.linear(gathered, fc1.weight[rows], fc1.bias[rows])), fc2.weight[:, rows])
        (partial * grad_out).sum().backward()
        terms.append(gathered.grad)
    reduce_scattered = sum(terms).chunk(WORLD)
    split = [t.chunk(WORLD)[r] for r, t in enumerate(terms)]
    for r in range(WORLD):
        assert torch.allclose(reduce_scattered[r], dense.chunk(WORLD)[r], atol=1e-12)
        assert not torch.allclose(split[r], dense.chunk(WORLD)[r], atol=1e-3)


def test_a_bias_added_before_the_reduce_scatter_is_counted_w_times():
    torch.manual_seed(3)
    partials = [torch.randn(SEQ, D, dtype=torch.float64) for _ in range(WORLD)]
    bias = torch.randn(D, dtype=torch.float64)
    dense = sum(partials) + bias
    before = sum(p + bias for p in partials)  # every rank adds it to its term
    after = [chunk + bias for chunk in sum(partials).chunk(WORLD)]  # each rank adds it to its chunk
    assert torch.allclose(before, dense + (WORLD - 1) * bias)
    assert torch.allclose(torch.cat(after), dense)


def test_the_norm_on_a_chunk_saves_a_chunk_and_fc1_saves_the_gathered_sequence():
    norm, fc1, _, x, _ = dense_modules()
    sizes = []

    def pack(tensor):
        sizes.append((tuple(tensor.shape), tensor.numel()))
        return tensor

    chunk = x.chunk(WORLD)[0].clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        normed = norm(chunk)
    saved_by_norm = [s for s in sizes if s[0] not in ((D,),)]  # leave out the weight and bias
    assert {s[0] for s in saved_by_norm} == {(SEQ // WORLD, BATCH, D), (SEQ // WORLD, BATCH, 1)}
    sizes.clear()
    gathered = torch.cat([normed] * WORLD)  # stands for the all-gather's output
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fc1(gathered)
    assert SEQ * BATCH * D in {s[1] for s in sizes}  # fc1 keeps the whole gathered sequence (as [s * b, d])


def test_the_weight_gradient_needs_the_whole_input_and_a_chunk_alone_gives_another_number():
    _, fc1, _, x, _ = dense_modules(4)
    width = HIDDEN // WORLD
    grad_hidden = torch.randn(SEQ, BATCH, width, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    rows = slice(0, width)  # rank 0's block of fc1
    dense = torch.einsum("sbh,sbd->hd", grad_hidden, x)  # from the whole (re-gathered) input
    weight = fc1.weight[rows].detach().clone().requires_grad_(True)
    (F.linear(x, weight) * grad_hidden).sum().backward()
    assert torch.allclose(weight.grad, dense)
    own = torch.einsum("sbh,sbd->hd", grad_hidden.chunk(WORLD)[0], x.chunk(WORLD)[0])
    assert not torch.allclose(own, dense, atol=1e-3)


def ring_bytes(n_bytes: int, world: int) -> dict:
    """Bytes each rank sends in ring collectives over a tensor of n_bytes: each step sends one chunk."""
    chunk = n_bytes // world
    reduce_scatter = (world - 1) * chunk
    all_gather = (world - 1) * chunk
    return {"all_reduce": reduce_scatter + all_gather, "reduce_scatter": reduce_scatter, "all_gather": all_gather}


def simulate_ring_reduce_scatter(chunks: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], int]:
    """A ring reduce-scatter played step by step: rank r ends with the sum of chunk r; the bytes one rank sent."""
    world = len(chunks)
    acc = [[c.clone() for c in rank_chunks] for rank_chunks in chunks]
    sent = 0
    for step in range(world - 1):
        messages = []
        for r in range(world):
            index = (r - step - 1) % world
            messages.append((r, index, acc[r][index].clone()))
        for r, index, tensor in messages:
            acc[(r + 1) % world][index] += tensor
        sent += messages[0][2].numel() * messages[0][2].element_size()
    return [acc[r][r] for r in range(world)], sent


def test_reduce_scatter_plus_all_gather_send_what_one_all_reduce_sends():
    n_bytes = SEQ * BATCH * D * 8
    counts = ring_bytes(n_bytes, WORLD)
    assert counts["reduce_scatter"] + counts["all_gather"] == counts["all_reduce"]
    torch.manual_seed(6)
    data = [list(torch.randn(SEQ, BATCH, D, dtype=torch.float64).chunk(WORLD)) for _ in range(WORLD)]
    results, sent = simulate_ring_reduce_scatter(data)
    assert sent == counts["reduce_scatter"]
    for r in range(WORLD):
        assert torch.allclose(results[r], sum(data[q][r] for q in range(WORLD)))


def chunk_dropout_masks(seeds: list[int]) -> list[torch.Tensor]:
    """The dropout mask each rank draws for its chunk of the sequence, after seeding torch with its seed."""
    masks = []
    with torch.random.fork_rng():
        for seed in seeds:
            torch.manual_seed(seed)
            kept = F.dropout(torch.ones(SEQ // WORLD, BATCH, HIDDEN, dtype=torch.float64), p=0.5, training=True)
            masks.append(kept != 0)
    return masks


def test_a_dropout_seeded_alike_on_every_rank_repeats_one_chunks_mask():
    alike = chunk_dropout_masks([1234] * WORLD)
    assert all(torch.equal(mask, alike[0]) for mask in alike)  # the sequence's mask: one chunk's, W times
    per_rank = chunk_dropout_masks([1234 + 2718 + rank for rank in range(WORLD)])  # Megatron's tp-rank offset
    assert not torch.equal(per_rank[0], per_rank[1]) and not torch.equal(per_rank[1], per_rank[2])
    # One draw for the whole sequence, cut into chunks, is not the repeated pattern either.
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        whole = F.dropout(torch.ones(SEQ, BATCH, HIDDEN, dtype=torch.float64), p=0.5, training=True) != 0
    assert not torch.equal(whole.chunk(WORLD)[1], alike[1])


def test_per_position_layers_commute_with_cutting_the_sequence():
    norm, fc1, _, x, _ = dense_modules()
    residual = torch.randn_like(x)
    whole = norm(x) + residual
    parts = [norm(xc) + rc for xc, rc in zip(x.chunk(WORLD), residual.chunk(WORLD))]
    assert torch.allclose(torch.cat(parts), whole)
    mask = torch.rand_like(x, generator=torch.Generator().manual_seed(7)) > 0.1
    assert torch.equal(torch.cat([m * xc for m, xc in zip(mask.chunk(WORLD), x.chunk(WORLD))]), mask * x)


# --- one world of three gloo ranks ------------------------------------------------------------------


def _observe(rank: int) -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    obs = {}
    chunk = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    gathered = funcol.all_gather_tensor_autograd(chunk, 0, dist.group.WORLD)
    weight = torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape) * (rank + 1)
    (funcol.wait_tensor(gathered) * weight).sum().backward()
    # The dense gradient of this rank's rows: the sum over the ranks of their weights' rows.
    total = sum(torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape) * (q + 1)
                for q in range(WORLD))
    obs["funcol_grad_error"] = float((chunk.grad - total.chunk(WORLD)[rank]).abs().max())
    return obs


def observe_main(ctx) -> dict:
    with ctx.group():
        return _observe(ctx.rank)


@pytest.fixture(scope="module")
def observed(session) -> list[dict]:
    return run_world(session, "quiz_demos.test_sequence_parallel:observe_main", WORLD)


@pytest.mark.slow
def test_functional_all_gather_autograd_sums_the_ranks_gradients_in_backward(observed):
    for obs in observed:
        assert obs["funcol_grad_error"] < 1e-12

