"""What exercises 41-43 share: the small configurations trained for real, the worker that calls the
learner's pure functions, the measurements (run once per grading process) and the wording of an
estimate beside what was measured.

Rank side (:mod:`grader.rank.drivers.shared.capacity_worker`): ``serve_main``, a worker answering ``call``
(the learner's function on each case, the answer read back as plain data, the learner's exceptions as
data); ``measure_main`` (:mod:`grader.rank.drivers.shared.capacity_run`), the kit's own runs. Grader side,
here: ``measured`` (each configuration's rank 0 record), ``ask``, ``compare_line``.
"""

from __future__ import annotations

import math

from grader import capacity
from grader.checks.interface import Grader

# The transformer every small configuration trains (41's Transformer): small enough for a CPU.
SMALL = capacity.ModelSpec(layers=4, hidden=32, heads=4, vocab=65, seq_len=16)  # 55,552 parameters: dp = 3 pads

# name -> plan; each runs on dp * tp * pp processes. Together they cover every dimension alone and
# in pairs, both precisions, every ZeRO stage (dp = 3 pads the flat buffer), every recomputation,
# both schedules with more and fewer micro-batches than stages, and GPipe with one stage.
CONFIGS = {
    "dp2 zero0 fp32": capacity.Plan(dp=2, zero=0, micro_batch=2, micro_batches=2, precision="fp32"),
    "dp2 zero1": capacity.Plan(dp=2, zero=1, micro_batch=2, micro_batches=2),
    "dp3 zero2": capacity.Plan(dp=3, zero=2, micro_batch=1, micro_batches=2),
    "dp3 zero3 selective": capacity.Plan(dp=3, zero=3, micro_batch=1, micro_batches=2, recompute="selective"),
    "tp2": capacity.Plan(tp=2, micro_batch=2),
    "tp2 selective": capacity.Plan(tp=2, micro_batch=2, recompute="selective"),
    "tp2 full fp32": capacity.Plan(tp=2, micro_batch=2, recompute="full", precision="fp32"),
    "pp2 gpipe": capacity.Plan(pp=2, micro_batches=4, schedule="gpipe"),
    "pp2 1f1b": capacity.Plan(pp=2, micro_batches=4, schedule="1f1b"),
    "pp4 1f1b m2": capacity.Plan(pp=4, micro_batches=2, schedule="1f1b"),
    "dp2 tp2 zero1": capacity.Plan(dp=2, tp=2, zero=1, micro_batch=2),
    "dp2 pp2 zero1 full": capacity.Plan(dp=2, pp=2, zero=1, micro_batches=3, recompute="full"),
    "tp2 pp2 gpipe selective": capacity.Plan(tp=2, pp=2, micro_batches=3, schedule="gpipe", recompute="selective"),
    # one stage under "gpipe": every forward before any backward, so all 3 micro-batches held (not 1)
    "gpipe one stage": capacity.Plan(dp=2, micro_batches=3, schedule="gpipe"),
}
SEED = 41

# Tolerances: params, grads, optimizer, traffic and FLOPs are exact; the activations' formula leaves
# out LayerNorm's saved mean and rstd (two per token a norm, in the activations' dtype on a CPU, fp32
# on a GPU): 0.57 to 1.12 % of what the configurations measure (tests/test_capacity_measured.py), less at
# scale (4e s b of 34 s b h). 1.5 % takes that gap and no wrong element size: a mask counted in 2 bytes
# under fp32 alone is 4.1 % off, every other wrong size more (tests/test_ex41_memory.py).
ACTIVATIONS_TOLERANCE = 0.015
EXACT = 0.5  # bytes: a float estimate rounds to the measured integer


def plain(model: capacity.ModelSpec, plan: capacity.Plan) -> dict:
    return {"model": capacity.exercise_dict(model), "plan": capacity.exercise_dict(plan)}


def layout(model: capacity.ModelSpec, plan: capacity.Plan) -> dict:
    """What the ranks of a measured run need of the cost model, worked out here and sent as data (the cost
    model is never in a rank): K and V heads, MLP widths, the mixture-of-experts layers, and for each pipeline
    rank the layers of its chunks and its schedule."""
    return {"kv_heads": capacity.kv_heads(model), "ffn": capacity.ffn(model), "expert_ffn": capacity.expert_ffn(model),
            "moe_layers": [i for i in range(model.layers) if capacity.is_moe(model, i)],
            "chunks": [capacity.chunk_layers(model, plan, stage) for stage in range(plan.pp)],
            "order": [[list(op) for op in capacity.schedule(plan, stage)] for stage in range(plan.pp)]}


def measure_kwargs(model: capacity.ModelSpec, plan: capacity.Plan, seed: int = SEED, **more) -> dict:
    """The kwargs of ``measure_main`` for ``model`` under ``plan``: every field of both, their layout, the seed."""
    return {"model": capacity.to_dict(model), "plan": capacity.to_dict(plan), "layout": layout(model, plan),
            "seed": seed, **more}


def describe(plan: capacity.Plan | dict) -> str:
    p = plan if isinstance(plan, dict) else capacity.to_dict(plan)
    default = capacity.to_dict(capacity.Plan())
    said = [f"{k}={v}" for k, v in p.items() if v != default[k]]
    return "Plan(" + ", ".join(said) + ")"


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


# --- in the grader ------------------------------------------------------------------------------------

# config name -> every rank's record. The runs are the kit's own (measure_main never imports the
# learner's file) and the same every grading, so a grading process measures once and reuses them.
_MEASURED: dict = {}


def measured(g: Grader, driver, names: list[str] | None = None) -> dict:
    """Each configuration's records (one per rank, rank order), measured once per grading process by ``driver``
    (the exercise's ``measure_main``, which runs :func:`grader.rank.drivers.shared.capacity_run.measure_main`)."""
    for name in names or list(CONFIGS):
        if name not in _MEASURED:
            plan = CONFIGS[name]
            outcome = g.run(driver, plan.world_size, kwargs=measure_kwargs(SMALL, plan),
                            label=f"measure {name}")
            _MEASURED[name] = outcome.results()
    return {name: _MEASURED[name] for name in names or list(CONFIGS)}


def ask(g: Grader, worker, function: str, cases: list) -> list:
    """The learner's answers to ``cases`` (see ``estimates``), numbers as floats, each checked before any
    check compares it: an answer that is not a list of answers, or a term that is not a finite number
    (NaN compares false with everything, so it would pass every ``abs(x - truth) > tol``), is marked
    ``nonfinite`` with the term named, and ``error_of`` reports it."""
    answers = g.call(worker, "estimates", function=function, cases=cases)
    if not isinstance(answers, list) or len(answers) != len(cases) or not all(isinstance(a, dict) for a in answers):
        g.stop(f"{function}: the worker's answers cannot be read (the submission's process sent something else)")
    for answer in answers:
        if isinstance(answer.get("value"), dict):
            answer["value"] = {str(k): (v if isinstance(v, dict) else _number(v)) for k, v in answer["value"].items()}
            bad = not_finite(answer["value"])
            if bad:
                answer["nonfinite"] = bad
        elif isinstance(answer.get("value"), float) and not math.isfinite(answer["value"]):
            answer["nonfinite"] = f"{answer['value']!r}"
    return answers


def not_finite(value, where: str = "") -> str | None:
    """The first term of ``value`` (a dict of numbers, nested dicts allowed) that is a float but not finite,
    as "activations = nan"; None when every number is finite."""
    for key, item in value.items():
        name = f"{where}.{key}" if where else str(key)
        if isinstance(item, dict):
            found = not_finite(item, name)
            if found:
                return found
        elif isinstance(item, float) and not math.isfinite(item):
            return f"{name} = {item!r}"
    return None


def relative(estimate: float, truth: float) -> float:
    if truth == 0:
        return 0.0 if estimate == 0 else float("inf")
    return (estimate - truth) / truth


def compare_line(term: str, estimate, truth: float, unit: str = "bytes") -> str:
    if not isinstance(estimate, (int, float)):
        return f"{term}: {estimate!r} estimated, {truth:,.0f} {unit} measured"
    return f"{term}: {estimate:,.0f} {unit} estimated, {truth:,.0f} measured ({relative(estimate, truth):+.1%})"


def error_of(answer: dict) -> str | None:
    """What went wrong with an answer that should have been a value, or None."""
    if "error" in answer:
        return f"raised {answer['error']}"
    if answer.get("nonfinite"):
        return f"returned {answer['nonfinite']}: every term must be a finite number"
    if not isinstance(answer.get("value"), dict):
        return f"returned {answer.get('value')!r}, not the stub's dataclass"
    return None


def check_refusals(g: Grader, function: str, answers: dict, check_id: str = "bad-plans-refused") -> None:
    """``function`` must have raised ValueError for each case of ``answers`` (what -> answer)."""
    for what, answer in answers.items():
        if not answer.get("value_error"):
            got = f"raised {answer['error']}" if "error" in answer else "returned an answer"
            g.record(check_id, False, f"{what}: {function} {got}, not ValueError")
            return
    g.record(check_id, True, f"ValueError for each of: {', '.join(answers)}")
