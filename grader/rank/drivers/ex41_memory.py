"""Exercise 41: training_memory: the driver, run in a worker (the checks that decide:
grader/checks/ex41_memory.py).

The worker answers the grader's calls with the learner's training_memory on each case it is sent
(:func:`grader.rank.drivers.shared.capacity_worker.estimates`); the ranks the grader measures run the kit's
own code alone (:func:`grader.rank.drivers.shared.capacity_run.measure_main`).
"""

from __future__ import annotations

from grader.rank.child import RankContext
from grader.rank.drivers.shared import capacity_run, capacity_worker


def serve_main(ctx: RankContext) -> dict:
    ctx.serve({"estimates": capacity_worker.estimates})
    return {}


def measure_main(ctx: RankContext) -> dict:
    """One measured training step of the kit's transformer under the plan the grader sends, on this rank (the
    learner's file is never imported)."""
    return capacity_run.measure_main(ctx)
