"""Demonstrations for the expert-parallel quiz topic, run on the installed torch.

Most claims are arithmetic in one process: the capacity of an expert, the queue order that decides
which assignments are dropped, the renormalised gates and the softmax over the top-k logits, the
Switch Transformer's load-balancing loss and what it is for a balanced and a collapsed router, and
what a gradient through dist.all_to_all_single's output would be. One world of two gloo ranks (run
once for the module, through the grader's harness) exchanges uneven splits with all_to_all_single,
shows that it is not differentiable, and runs torch.distributed.nn.functional.all_to_all_single's
backward (the same all-to-all, split sizes swapped).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from quiz_demos.world import run_world

WORLD = 2


def queue_places(experts_chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each assignment's place in its expert's queue, the assignments taken in the given order."""
    one_hot = F.one_hot(experts_chosen, num_experts)
    return (one_hot.cumsum(dim=0) * one_hot).sum(dim=1) - 1


def switch_loss(probs: torch.Tensor, top_experts: torch.Tensor) -> torch.Tensor:
    tokens, num_experts = probs.shape
    top_k = top_experts.shape[1]
    fraction = torch.bincount(top_experts.flatten(), minlength=num_experts).to(probs.dtype) / (tokens * top_k)
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def test_capacity_of_an_expert_per_sending_rank():
    tokens, top_k, num_experts, capacity_factor = 16, 2, 12, 1.25
    assert math.ceil(capacity_factor * tokens * top_k / num_experts) == 4
    # Without the ceiling the formula gives 3.33; the mean load per expert is 32 / 12 = 2.67.
    assert capacity_factor * tokens * top_k / num_experts == pytest.approx(3.333, abs=1e-3)
    assert int(capacity_factor * tokens * top_k / num_experts) == 3


def test_choice_major_queue_keeps_first_choices_before_second_ones():
    """Four tokens, two experts: expert 0 is the second choice of tokens 0 and 1 and the first of 2 and 3."""
    top_experts = torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]])
    capacity = 2
    choice_major = top_experts.t().reshape(-1)  # first choices of tokens 0..3, then second choices
    kept = (queue_places(choice_major, 2) < capacity).view(2, 4).t()
    assert kept.tolist() == [[True, False]] * 4  # every token keeps its first choice
    token_major = top_experts.reshape(-1)  # token 0's two choices, then token 1's...
    kept_token_order = (queue_places(token_major, 2) < capacity).view(4, 2)
    assert kept_token_order.tolist() == [[True, True], [True, True], [False, False], [False, False]]


def test_renormalised_gates_equal_a_softmax_over_the_top_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, dim=-1)
    top_p, top_e = probs.topk(2, dim=-1)
    gates = top_p / top_p.sum(dim=-1, keepdim=True)
    assert torch.allclose(gates, torch.softmax(logits.gather(1, top_e), dim=-1), atol=1e-15)
    assert torch.allclose(gates.sum(-1), torch.ones(5, dtype=torch.float64))
    assert bool((top_p.sum(-1) < 1).all())  # without renormalising, a token's output shrinks


def test_switch_loss_is_one_when_balanced_and_e_when_collapsed():
    num_experts, tokens = 4, 8
    balanced_probs = torch.full((tokens, num_experts), 1 / num_experts, dtype=torch.float64)
    balanced_choice = torch.arange(tokens).remainder(num_experts)[:, None]
    assert float(switch_loss(balanced_probs, balanced_choice)) == pytest.approx(1.0)
    collapsed_probs = torch.zeros(tokens, num_experts, dtype=torch.float64)
    collapsed_probs[:, 0] = 1.0
    collapsed_choice = torch.zeros(tokens, 1, dtype=torch.long)
    assert float(switch_loss(collapsed_probs, collapsed_choice)) == pytest.approx(num_experts)


def test_switch_loss_gradient_reaches_the_router_through_the_probabilities_only():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.softmax(logits, dim=-1)
    top_e = probs.topk(1, dim=-1).indices
    loss = switch_loss(probs, top_e)
    loss.backward()
    assert logits.grad is not None and float(logits.grad.abs().sum()) > 0
    # The counts are integers from topk: no gradient flows through them.
    assert not torch.bincount(top_e.flatten(), minlength=4).is_floating_point()


def test_dropped_assignments_of_a_skewed_router():
    """Every token of a rank picks expert 0 first: with capacity 4 of 16, twelve first choices go."""
    tokens, capacity = 16, 4
    first_choices = torch.zeros(tokens, dtype=torch.long)
    kept = queue_places(first_choices, 12) < capacity
    assert int(kept.sum()) == capacity and kept[:capacity].all() and not kept[capacity:].any()


# --- two gloo ranks ------------------------------------------------------------------------------


def _observe(rank: int) -> dict:
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn

    obs = {}
    # Uneven splits: rank 0 sends 1 row to itself and 3 to rank 1; rank 1 sends 2 and 2.
    send = [[1, 3], [2, 2]][rank]
    recv = [[1, 2], [3, 2]][rank]
    rows = torch.full((sum(send), 2), float(rank), dtype=torch.float64, requires_grad=True)
    out = torch.empty(sum(recv), 2, dtype=torch.float64)
    dist.all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send)
    obs["received_from"] = out[:, 0].tolist()
    obs["plain_out_requires_grad"] = out.requires_grad
    # Counts first: each rank tells every rank how many rows it will send there.
    counts = torch.tensor(send)
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts)
    obs["counts_received"] = incoming.tolist()
    # The autograd form: backward is the all-to-all with the split sizes swapped.
    out = dist_nn.all_to_all_single(torch.empty(sum(recv), 2, dtype=torch.float64), rows, recv, send)
    weight = torch.arange(1, sum(recv) + 1, dtype=torch.float64)[:, None]
    (out * weight).sum().backward()
    obs["grad_rows"] = rows.grad[:, 0].tolist()
    return obs


def observe_main(ctx) -> dict:
    with ctx.group():
        return _observe(ctx.rank)


@pytest.fixture(scope="module")
def observed(session) -> list[dict]:
    return run_world(session, "quiz_demos.test_expert_parallel:observe_main", WORLD)


@pytest.mark.slow
def test_all_to_all_single_uneven_splits_and_counts(observed):
    assert observed[0]["received_from"] == [0.0, 1.0, 1.0]
    assert observed[1]["received_from"] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert observed[0]["counts_received"] == [1, 2] and observed[1]["counts_received"] == [3, 2]


@pytest.mark.slow
def test_plain_all_to_all_single_output_has_no_autograd(observed):
    assert observed[0]["plain_out_requires_grad"] is False


@pytest.mark.slow
def test_autograd_all_to_all_sends_gradients_back_where_rows_came_from(observed):
    # Rank 0 received [r0, r1, r1] with weights 1, 2, 3: its own row gets 1, rank 1's two rows get 2 and 3.
    # Rank 1 received [r0, r0, r0, r1, r1] with weights 1..5: rank 0's three rows get 1, 2, 3.
    assert observed[0]["grad_rows"] == [1.0, 1.0, 2.0, 3.0]
    assert observed[1]["grad_rows"] == [2.0, 3.0, 4.0, 5.0]
