"""Exercise 11: FullyShardedDP, fully sharded data parallel (ZeRO stage 3) by hand.

One run per world size. Each rank builds the grader's model (different on every
rank, on purpose: the wrapper must start from rank 0's), wraps it in the learner's
FullyShardedDP and trains it three times:

- "sgd": float32, plain SGD. Every torch.distributed call is recorded (with marks
  where forward, backward and finish_gradient_synchronization return), and after
  each step what the rank holds: the storages of every tensor reachable from the
  wrapper (its attributes, containers, hooks and their closures, the learner's
  globals, every .grad), counted once each. In one step a probe inside each unit's
  forward, and one where its backward begins, record which units' full parameters
  are in memory at that moment: found by content (the bytes of each unit's weight
  as full_state_dict() gave them before the step) among the tensors reachable from
  the wrapper and from the learner's running functions, and those autograd saved
  for backward.
- "adamw": float64, AdamW.
- "uneven": float32, SGD, on a model whose units' sizes divide by no world size.

The last two run under a short collective timeout, and an exception there is
recorded rather than raised. The grader replays single-process training of rank
0's model on the global batch, and decides every check.
"""

from __future__ import annotations

from grader.rank.drivers.ex11_fsdp import rank_main
from grader.checks.ex11_fsdp.verdicts import (check_collectives, check_frozen, check_held, check_keys, check_no_error,
                                              check_probes, check_start, check_training, check_uneven_gathers)
from grader.checks.interface import Grader
from grader.checks.shared import timelines


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        outcome = g.run(rank_main, world_size)
        timelines.keep(g, outcome, f"world size {world_size}")
        observations = outcome.results()
        sgd = [o["sgd"] for o in observations]
        check_keys(g, sgd, "sgd", world_size)
        check_start(g, sgd, world_size)
        check_training(g, "matches-sgd", sgd, "sgd", world_size)
        check_frozen(g, sgd, "sgd", world_size)
        check_held(g, sgd, world_size)
        check_probes(g, sgd, world_size)
        check_collectives(g, sgd, world_size)
        adamw = [o["adamw"] for o in observations]
        if check_no_error(g, "matches-adamw", adamw, "the float64 model trained with AdamW", world_size):
            check_keys(g, adamw, "adamw", world_size)
            check_training(g, "matches-adamw", adamw, "adamw", world_size)
            check_frozen(g, adamw, "adamw", world_size)
        if any("uneven" not in o for o in observations):
            g.record("uneven-sizes", False, "not run: the run on the float64 model with AdamW failed first (see "
                     "matches-adamw), and the model that needs padding was to run after it", world_size=world_size)
            continue
        uneven = [o["uneven"] for o in observations]
        if check_no_error(g, "uneven-sizes", uneven, "the model whose unit sizes do not divide by the world size",
                   world_size):
            check_training(g, "uneven-sizes", uneven, "uneven", world_size)
            check_uneven_gathers(g, uneven, world_size)
    if max(g.world_sizes) == 1:  # --world-size 1: each slice is its whole unit
        g.skip("two-units-at-a-time", "needs a world size of 2 or more: with one rank a slice is the whole unit")
