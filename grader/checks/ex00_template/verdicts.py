"""Exercise 00's verdicts: pure functions of the ranks' records (``tests/test_template.py`` feeds them hand-made
ones), each recording its check once per rank with what was observed, in terms a learner acts on."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex00_template import rank_tensor
from grader.checks.interface import Grader
from grader.compare import tensor_difference


def check_sum(g: Grader, records: list[dict], expected: torch.Tensor, world_size: int) -> None:
    for rank, record in enumerate(records):
        found = tensor_difference(record.get("returned"), expected, name="the returned tensor")
        g.record("sum-everywhere", found is None, f"{found}: expected the sum over all {world_size} ranks",
                 rank=rank, world_size=world_size)


def check_input_kept(g: Grader, records: list[dict], world_size: int) -> None:
    for rank, record in enumerate(records):
        found = tensor_difference(record.get("input_after"), rank_tensor(rank), name="t")
        g.record("input-kept", found is None, f"{found} after the call: sum into a copy (t.clone()), not into t",
                 rank=rank, world_size=world_size)
