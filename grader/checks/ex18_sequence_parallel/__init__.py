"""Exercise 18: SequenceParallelBlock (Megatron-style sequence parallelism around a tensor-parallel MLP).

Rank side (rank.py): every rank builds the same dense LayerNorm, fc1 and fc2
(float64, seeded), wraps them in the learner's block, measures the bytes the block holds, feeds its
chunk of x and runs backward of sum(output * G). It records the output, x's gradient, every
parameter's value and .grad, every collective of forward and of backward (torch.distributed's calls,
and the functional collectives autograd runs from C++, which a dispatch mode sees), and what autograd saved
during forward (saved_tensors_hooks: each storage once, with its bytes and values). Then, in the same
run: (in the largest world) two groups, the even and the odd ranks, each with a block and a sequence
of its own; a hidden size the world size does not divide; an input whose last dimension is wrong. One
more run per pattern gives the ranks chunks of different lengths (rank 0 one longer; lengths whose sum is
W times the mean, which a check of the total misses). Grader side: the dense block runs in this
process on the same modules and input; each rank's tensors are compared with its chunk or block of the
dense ones. The parameters are found by their values (the names are the learner's); the tensors autograd
saved are sorted into the parallel region's (fc1's gathered input, the hidden blocks) and the rest by the
shapes they were saved in, never by their values, so that a wrong GELU or eps fails the output alone. A
second forward and backward of the same block, its gradients cleared between, must give what the first
gave (hooks registered in forward pile up there). The verdicts that need no dense block (the collectives,
the refusals) are in verdicts.py.
"""

from __future__ import annotations

from grader.rank.drivers.ex18_sequence_parallel import UNEVEN_PATTERNS, rank_main, uneven_main
from grader.checks.ex18_sequence_parallel.reference import expected_main, outside_bytes_dense
from grader.checks.ex18_sequence_parallel.verdicts import (activation_collectives, check_collectives, check_group,
                                                           check_held, check_hidden, check_input_grad, check_output,
                                                           check_replicated, check_saved, check_second_step,
                                                           check_shape, check_slices, check_uneven, rank_saved)
from grader.checks.interface import Grader
from grader.checks.shared import timelines


def grade(g: Grader) -> None:
    largest = max(g.world_sizes)
    runs = [g.Run(rank_main, world_size, {"groups": world_size == largest}) for world_size in g.world_sizes]
    if largest >= 2:  # chunks of different lengths, each pattern in a run of its own: gloo may abort a rank there
        runs += [g.Run(uneven_main, largest, {"pattern": pattern}, expect_ok=False) for pattern in UNEVEN_PATTERNS]
    started = timelines.clock()
    outcomes = g.run_at_once(runs)  # light runs: a re-grade waits for the slowest, not for their sum
    lines = []
    for world_size in g.world_sizes:
        outcome = next(outcomes)
        timelines.keep(g, outcome, f"world size {world_size}", started=started)
        observations = outcome.results()
        want = expected_main(world_size)
        main_ok = all([check_output(g, observations, want, world_size),
                       check_input_grad(g, observations, want, world_size),
                       check_slices(g, observations, want, world_size),
                       check_replicated(g, observations, want, world_size)])
        check_second_step(g, observations, world_size)
        check_collectives(g, observations, world_size)
        check_saved(g, observations, want, world_size)
        check_held(g, observations, want, world_size)
        check_hidden(g, observations, world_size)
        check_shape(g, observations, world_size)
        if world_size == largest:
            check_group(g, observations, world_size, main_ok)
        lines.append(describe(observations, want, world_size))
    if largest >= 2:
        for pattern in UNEVEN_PATTERNS:
            check_uneven(g, next(outcomes), largest, pattern)
    else:
        g.skip("uneven-sequence-refused", "one rank: every sequence is divisible by 1")
    g.section("the block, as measured", "\n".join(lines))


# --- the report's section -----------------------------------------------------------------------


def describe(observations: list[dict], want: dict, world_size: int) -> str:
    """One line per world size: rank 0's collectives, its saves outside the region, its bytes held."""
    run = observations[0]["main"]
    parts = []
    for phase in ("forward", "backward"):
        kinds = activation_collectives(run[f"{phase}_events"], world_size)
        parts.append(f"{phase}: {len(kinds['gather'])} all-gather, {len(kinds['scatter'])} reduce-scatter, "
                     f"{len(kinds['other'])} other")
    entries = rank_saved(observations[0], want, 0, world_size)
    outside = sum(e["bytes"] for e in entries if e["kind"] == "outside")
    return (f"world size {world_size}, rank 0: {'; '.join(parts)}; saved outside the parallel region {outside} bytes "
            f"(the dense block: {outside_bytes_dense(want)}); its block holds {observations[0]['held_bytes']} bytes")
