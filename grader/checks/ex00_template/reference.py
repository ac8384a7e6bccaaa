"""Exercise 00, grader side: the expected values, computed in the grader's own process."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex00_template import rank_tensor


def expected_sum(world_size: int) -> torch.Tensor:
    """What every rank's sum_over_ranks should return."""
    return torch.stack([rank_tensor(rank) for rank in range(world_size)]).sum(dim=0)
