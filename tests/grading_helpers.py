"""What the tests of an exercise's verdicts share: a Grading that records verdicts without starting a
process, and the verdicts it then holds. A test module binds its exercise once:

    grading = grading_for("11")   # grading() or grading(3): a fresh Grading for 2 or 3 ranks
"""

from __future__ import annotations

from typing import Callable

from grader import catalog
from grader.grading import Grading, Plan


def grading_for(exercise_id: str, world_size: int = 2, *, backend: str = "gloo", session=None,
                timeout_s: float | None = None) -> Callable[..., Grading]:
    """``grading(world_size=world_size) -> Grading`` for exercise ``exercise_id``, graded as its solution is
    (no session: nothing may start a process)."""
    exercise = catalog.by_id(exercise_id)
    extra = {} if timeout_s is None else {"timeout_s": timeout_s}

    def grading(world_size: int = world_size) -> Grading:
        return Grading(exercise, f"solutions/{exercise.filename}", session, Plan(backend, [world_size]), **extra)

    return grading


def verdicts(g: Grading) -> dict:
    """{check id: (status, message)} of every check the grading decided."""
    return {c.id: (c.status, c.message) for c in g.results(None) if c.status != "error"}
