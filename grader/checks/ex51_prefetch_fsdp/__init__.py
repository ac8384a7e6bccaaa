"""Exercise 51: PrefetchingFSDP, fully sharded data parallel with its communication hidden under computation.

One run per world size, its inputs drawn from a seed the grader picks for this grading. Each rank builds the
grader's model (different on every rank, on purpose: the wrapper must start from rank 0's), wraps it in the
learner's PrefetchingFSDP and trains it three steps with SGD in float64, recording:

- each step's forward output, the .grad of every trainable parameter the wrapper yields (its slices) after
  finish_gradient_synchronization(), and full_state_dict() after the optimizer step;
- the order of events in each step: every collective when it is issued and when its work is waited for
  (grader.rank.probes.watch_issue_and_wait; a blocking call is waited for at once), and each unit's marks,
  made by the grader's own units: where its forward begins and ends, where its backward begins (the gradient
  of its output has arrived, the learner's hooks on it have run) and ends (the gradient of its input is
  computed);
- in the second step, as each unit's forward and backward begin, which units' full parameters are in memory
  (found by content among the tensors reachable from the wrapper and the learner's running functions, and those
  autograd saved for backward), every collective in flight first allowed to finish.

The grader replays single-process training of rank 0's model on the global batch and decides every check:
the numbers are compared here (value); the order of events and the units in memory are the rank's own record
(claim).
"""

from __future__ import annotations

import secrets

from grader.checks.ex51_prefetch_fsdp.reference import gathered_sizes, reference_steps, slice_sizes
from grader.checks.ex51_prefetch_fsdp.verdicts import (check_backward_prefetch, check_collectives,
                                                      check_forward_prefetch, check_probes, check_reduce_scatters,
                                                      check_training)
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.drivers.ex51_prefetch_fsdp import rank_main


def grade(g: Grader) -> None:
    seed = secrets.randbelow(1 << 30)
    for world_size in g.world_sizes:
        outcome = g.run(rank_main, world_size, kwargs={"seed": seed})
        timelines.keep(g, outcome, f"world size {world_size}", shown=world_size == max(g.world_sizes),
                       draw=("step 2",))
        observations = outcome.results()
        check_training(g, observations, reference_steps(seed, world_size), world_size)
        gathered, sliced = gathered_sizes(world_size), slice_sizes(world_size)
        check_collectives(g, observations, world_size, gathered, sliced)
        check_forward_prefetch(g, observations, world_size, gathered, sliced)
        check_backward_prefetch(g, observations, world_size, gathered, sliced)
        check_reduce_scatters(g, observations, world_size, gathered, sliced)
        check_probes(g, observations, world_size)
    if max(g.world_sizes) == 1:  # --world-size 1: each slice is its whole unit
        g.skip("two-units-at-a-time", "needs a world size of 2 or more: with one rank a slice is the whole unit")
