"""Exercise 00, rank side: the tensor each rank holds (the grader builds the same ones) and the driver (the checks
that decide: grader/checks/ex00_template/)."""

from __future__ import annotations

import torch

from grader.rank.child import RankContext
from grader.rank.drivers.shared.recording import plain_tensor

SIZE = 4


def rank_tensor(rank: int) -> torch.Tensor:
    """Rank ``rank``'s input, the same in the rank and in the grader."""
    return torch.arange(SIZE, dtype=torch.float64) + 10 * rank


def rank_main(ctx: RankContext) -> dict:
    """The learner's sum_over_ranks on this rank's tensor: what it returned and what is left of its input."""
    sum_over_ranks = ctx.function("sum_over_ranks")  # imports the learner's file
    t = rank_tensor(ctx.rank)
    with ctx.group():  # the grader's process group: this exercise's learner does not set one up
        returned = sum_over_ranks(t)
    return {"returned": plain_tensor(returned), "input_after": t.clone()}
