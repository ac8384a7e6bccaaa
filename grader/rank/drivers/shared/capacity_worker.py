"""What the workers of exercises 41-43 answer (each exercise's ``serve_main``): the learner's pure function on
each case the grader sends, built from the learner's own dataclasses, each answer read back as plain data and
each exception the learner's code raised as data (the grader, :mod:`grader.checks.shared.capacity_cases`,
decides on them outside)."""

from __future__ import annotations

from grader.rank.child import RankContext


def estimates(ctx: RankContext, function: str, cases: list) -> list:
    """``function`` of the learner's file on each case (``{"model", "plan", "cluster"?, "tokens"?}``),
    built from the learner's own dataclasses; each answer as ``{"value": plain data}`` or
    ``{"error": "ExceptionName: message", "value_error": bool}``."""
    learner = ctx.function(function)
    answers = []
    for case in cases:
        try:
            args = [_build(ctx, "ModelSpec", case["model"])]
            if "plan" in case:
                args.append(_build(ctx, "Plan", case["plan"]))
            if "cluster" in case:
                args.append(_build(ctx, "Cluster", case["cluster"]))
            if "tokens" in case:
                args.append(case["tokens"])
            answers.append({"value": _answer_fields(learner(*args))})
        except NotImplementedError:
            raise
        except Exception as exc:  # the learner's error is an answer: some cases must raise
            answers.append({"error": f"{type(exc).__name__}: {exc}"[:300], "value_error": isinstance(exc, ValueError)})
    return answers


def _build(ctx: RankContext, name: str, values: dict):
    try:
        cls = ctx.function(name)
    except Exception:
        raise TypeError(f"the file defines no {name} (keep the stub's dataclasses)") from None
    return cls(**values)


FIELDS = ("params", "grads", "optimizer", "activations", "total",
          "dp", "tp", "pp",
          "flops", "compute_s", "dp_s", "tp_s", "pp_s", "bubble_s", "exposed_dp_s", "total_s",
          "zero", "micro_batch", "micro_batches", "schedule", "precision", "recompute")


def _answer_fields(value):
    """An answer as plain data: the fields 41-43 define, read as attributes or keys."""
    if isinstance(value, (int, float, str)) or value is None:
        return value if not isinstance(value, bool) else int(value)
    if isinstance(value, dict):
        return {str(k): _answer_fields(v) for k, v in value.items()}
    out = {}
    for name in FIELDS:
        if hasattr(value, name):
            out[name] = _answer_fields(getattr(value, name))
    if not out:
        raise TypeError(f"returned a {type(value).__name__}, not the stub's dataclass")
    return out
