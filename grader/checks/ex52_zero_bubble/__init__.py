"""Exercise 52: zero_bubble_step, 13's pipeline under the ZB-H1 schedule (the backward split into B, the input's
gradient, and W, the weights').

Rank side (grader/rank/drivers/ex52_zero_bubble.py): one run per world size, two steps (2W and W + 1
micro-batches), the model and the batch drawn from a seed the grader picks for this grading. Each rank records its
stage's gradients, what it returned, one list of events in the order they happened (each forward, each backward
entering the stage, each micro-batch's weights' gradients completed, each send and receive) and the most
micro-batches' saved activations it held at once.

Grader side: the gradients and the loss are compared here with the whole model on the whole batch in one process
(value); the passes and messages, their order against ZB-H1's, the idle slots in unit time and the activations
held are the ranks' own record (claim). The report draws each run as a slot table.
"""

from __future__ import annotations

import secrets

from grader import timeline
from grader.checks.ex52_zero_bubble.reference import cases_for, expected_step
from grader.checks.ex52_zero_bubble.verdicts import (Unreadable, check_bubble, check_gradients, check_loss,
                                                     check_memory, check_messages, check_micro_batches, check_order,
                                                     read_steps, timeline_data, timeline_text)
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.drivers.ex52_zero_bubble import pipeline_main

SEED_RANGE = 1 << 30


def grade(g: Grader) -> None:
    seed = secrets.randbelow(SEED_RANGE)
    sizes = list(g.world_sizes)
    runs = []
    for world_size in sizes:
        cases = cases_for(world_size)
        outcome = g.run(pipeline_main, world_size, kwargs={"seed": seed, "cases": cases})
        timelines.keep(g, outcome, f"world size {world_size}", shown=world_size == sizes[-1])
        try:
            steps = [read_steps(result, len(cases)) for result in outcome.results()]
        except Unreadable as problem:
            g.stop(f"world size {world_size}: a rank's record could not be read ({problem})")
        for i, case in enumerate(cases):
            per_rank = [s[i] for s in steps]
            grads, loss = expected_step(seed, case, world_size)
            check_gradients(g, case, per_rank, grads, world_size)
            check_loss(g, case, per_rank, loss, world_size)
            check_micro_batches(g, case, per_rank, world_size)
            if world_size >= 2:
                check_messages(g, case, per_rank, world_size)
            check_order(g, case, per_rank, world_size)
            check_bubble(g, case, per_rank, world_size)
            check_memory(g, case, per_rank, world_size)
        runs.append(timeline_data(cases[0], [s[0] for s in steps], world_size))
    last = runs[-1]
    view = timeline.slot_view(last["order"], last["slots"],
                              notes=[f"peak: {p} micro-batch{'' if p == 1 else 'es'}' activations"
                                     for p in last["peak_live"]],
                              caption=f"world size {last['world_size']}, {last['num_microbatches']} micro-batches, "
                                      "in unit time slots")
    g.section("the ZB-H1 schedule as each rank ran it", timeline_text(last), {"runs": runs, timeline.SLOT_KEY: view})
    if max(sizes) < 2:
        g.skip("neighbour-messages", "a pipeline of one stage sends nothing (use --world-size 2 or more)")
