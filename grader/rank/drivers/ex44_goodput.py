"""Exercise 44: goodput and the best checkpoint interval, graded against a seeded simulation of failures and
against what the Llama 3 paper reports for 405B on 16,384 GPUs: the drivers, run in each rank (the checks that
decide: grader/checks/ex44_goodput.py).

The learner's two functions on each job, built from the learner's own dataclasses, every answer sent back as
it came.
"""

from __future__ import annotations

from grader.rank.child import RankContext
from grader.rank.drivers.shared.learner_errors import learner_error


def serve_main(ctx: RankContext) -> dict:
    ctx.serve({"answers": answers})
    return {}


def answers(ctx: RankContext, function: str, cases: list) -> list:
    """The learner's ``function`` on each case ({"cluster", "job"}), built from the learner's own
    dataclasses; each answer as it came ({"value"} for an int or a float, {"shown"} for anything
    else) or the exception it raised ({"error", "value_error"})."""
    learner = ctx.function(function)
    out = []
    for case in cases:
        try:
            value = learner(_build(ctx, "Cluster", case["cluster"]), _build(ctx, "Job", case["job"]))
        except NotImplementedError:
            raise
        except Exception as exc:  # the learner's error is an answer: some cases must raise
            out.append({"error": learner_error(exc), "value_error": isinstance(exc, ValueError)})
            continue
        try:
            number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        except OverflowError:  # an int too large for a float
            number = None
        if number is None:
            out.append({"shown": f"{type(value).__name__} {value!r}"[:120]})
        else:
            out.append({"value": number})
    return out


def _build(ctx: RankContext, name: str, values: dict):
    try:
        cls = ctx.function(name)
    except Exception:
        raise TypeError(f"the file defines no {name} (keep the stub's dataclasses)") from None
    return cls(**values)
