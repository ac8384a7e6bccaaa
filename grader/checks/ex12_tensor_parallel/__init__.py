"""Exercise 12: ColumnParallelLinear, RowParallelLinear and ParallelMLP (Megatron-style tensor parallelism).

Rank side: every rank builds the same full nn.Linear layers (seeded), wraps them in
the learner's classes, feeds the same input and runs forward and backward with the
loss sum(output * G) for a fixed G, so that the output's gradient is G. It records
the output, the input's gradient, every parameter's value and .grad, the bytes of
the tensors its module holds, and the collectives made in forward and in backward.
Four scenarios, in this order: each layer alone, the MLP, the MLP without biases,
and feature counts not divisible by the world size. There each class may refuse the
split at construction (a ValueError or an assert, on every rank) or split unevenly (as
torch.tensor_split or DTensor do); what is built runs forward and backward, the row
layer fed the input block its weight's width implies. Grader side: the dense layers
and MLP run in the grader's own process on the same weights and inputs; every rank's
tensors are compared with them (or with this rank's block of them).
"""

from __future__ import annotations

from grader.rank.drivers.ex12_tensor_parallel import SEEDS, rank_main
from grader.checks.ex12_tensor_parallel.reference import dense
from grader.checks.ex12_tensor_parallel.verdicts import (check_collectives, check_column, check_held, check_mlp,
                                                         check_no_bias, check_row, check_uneven, check_weight_grads)
from grader.checks.interface import Grader
from grader.checks.shared import timelines


def grade(g: Grader) -> None:
    expected = {scenario: dense(scenario) for scenario in SEEDS}
    uneven_seen = []
    for world_size in g.world_sizes:
        outcome = g.run(rank_main, world_size)
        timelines.keep(g, outcome, f"world size {world_size}")
        observations = outcome.results()
        check_column(g, observations, expected["column"], world_size)
        check_row(g, observations, expected["row"], world_size)
        check_mlp(g, observations, expected["mlp"], world_size)
        check_weight_grads(g, observations, expected, world_size)
        check_collectives(g, observations, world_size)
        check_held(g, observations, expected["mlp"], world_size)
        check_no_bias(g, observations, expected["no_bias"], world_size)
        said = check_uneven(g, observations, world_size)
        if said:
            uneven_seen.append(said)
    if uneven_seen:
        g.section("feature counts the world size does not divide", "\n".join(uneven_seen))
