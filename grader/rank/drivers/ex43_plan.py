"""Exercise 43: choose_plan: the driver, run in a worker (the checks that decide: grader/checks/ex43_plan.py).

The worker answers the grader's calls with the learner's training_memory, step_time and choose_plan on each
case it is sent (:func:`grader.rank.drivers.shared.capacity_worker.estimates`); the ranks the grader measures
run the kit's own code alone (:func:`grader.rank.drivers.shared.capacity_run.measure_main`).
"""

from __future__ import annotations

from grader.rank.child import RankContext
from grader.rank.drivers.shared import capacity_worker


def serve_main(ctx: RankContext) -> dict:
    ctx.serve({"estimates": capacity_worker.estimates})
    return {}
