"""Exercise 41: training_memory, graded against measurement (rank side: the kit trains the small
transformer under each configuration and records what rank 0 holds, :mod:`.shared.capacity_run`;
the learner's function answers in a worker; grader side: term by term against the record, then
against the ZeRO paper's figure 1 and Korthikanti et al.'s table 2, then the refusals)."""

from __future__ import annotations

from grader import capacity
from grader.checks.interface import Grader
from grader.checks.shared import capacity_cases as cases
from grader.rank.drivers.ex41_memory import measure_main, serve_main

# (41-43 share their rank side: the measured runs, capacity_run.measure_main; the worker, capacity_worker.estimates)

TERMS = {"params": "params-measured", "grads": "grads-measured", "optimizer": "optimizer-measured",
         "activations": "activations-measured"}

# The ZeRO paper's figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam, model states per GPU.
ZERO_MODEL = capacity.ModelSpec(layers=32, hidden=4096, heads=32, vocab=128256, seq_len=8192)  # 7.53e9 parameters
ZERO_FIGURE_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
ZERO_TOLERANCE = 0.03  # the figure rounds to 0.1 GB, and this model has 7.53e9 parameters, not 7.5e9

# Korthikanti et al. 2022, table 2: one layer's activations in 16-bit, s b h (10 + 24/t + 5 a s / (h t)).
KORTHIKANTI_MODEL = capacity.ModelSpec(layers=1, hidden=12288, heads=96, vocab=51200, seq_len=2048)


def korthikanti(t: int, recompute: str) -> float:
    s, b, h, a = 2048, 1, 12288, 96
    if recompute == "full":
        return 2 * s * b * h
    attention = 5 * a * s / (h * t) if recompute == "none" else 0
    return s * b * h * (10 + 24 / t + attention)


BAD_PLANS = {
    "a plan with 3 pipeline stages for 4 layers": capacity.Plan(pp=3),
    "a plan with tp 3 for 4 heads": capacity.Plan(tp=3),
    "a plan with ZeRO 3 and 2 pipeline stages": capacity.Plan(dp=2, pp=2, zero=3),
    "a plan with schedule 'zero-bubble'": capacity.Plan(schedule="zero-bubble"),
    "a plan with recompute 'half'": capacity.Plan(recompute="half"),
    "a plan with 0 micro-batches": capacity.Plan(micro_batches=0),
}


def grade(g: Grader) -> None:
    worker = g.worker(serve_main)
    try:
        small = cases.ask(g, worker, "training_memory", [cases.plain(cases.SMALL, p) for p in cases.CONFIGS.values()])
        zero = cases.ask(g, worker, "training_memory",
                         [cases.plain(ZERO_MODEL, capacity.Plan(dp=64, zero=z)) for z in ZERO_FIGURE_GB])
        paper_plans = [(t, r) for t in (1, 8) for r in capacity.RECOMPUTES]
        paper = cases.ask(g, worker, "training_memory",
                          [cases.plain(KORTHIKANTI_MODEL, capacity.Plan(tp=t, recompute=r)) for t, r in paper_plans])
        bad = cases.ask(g, worker, "training_memory", [cases.plain(cases.SMALL, p) for p in BAD_PLANS.values()])
    finally:
        worker.close()
    records = cases.measured(g, measure_main)
    check_measured(g, dict(zip(cases.CONFIGS, small)), records)
    check_total(g, small + zero + paper)
    check_zero_paper(g, zero)
    check_korthikanti(g, dict(zip(paper_plans, paper)))
    cases.check_refusals(g, "training_memory", dict(zip(BAD_PLANS, bad)))


def measured_terms(record: dict) -> dict:
    return {term: record[f"{term}_bytes"] for term in TERMS}


def check_measured(g: Grader, answers: dict, records: dict) -> None:
    """Each term of each configuration against rank 0's measurement; a section with every figure."""
    lines, failed = [], {check: [] for check in TERMS.values()}
    for name, answer in answers.items():
        truth = measured_terms(records[name][0])
        plan = cases.describe(cases.CONFIGS[name])
        problem = cases.error_of(answer)
        if problem:
            for check in TERMS.values():
                failed[check].append(f"{name}, {plan}: training_memory {problem}")
            continue
        lines.append(f"{name} ({plan}, {cases.CONFIGS[name].world_size} processes), rank 0:")
        for term, check in TERMS.items():
            estimate = answer["value"].get(term)
            lines.append("  " + cases.compare_line(term, estimate, truth[term]))
            tolerance = cases.ACTIVATIONS_TOLERANCE * truth[term] if term == "activations" else cases.EXACT
            if not isinstance(estimate, float) or abs(estimate - truth[term]) > tolerance:
                failed[check].append(f"{name}, {plan}: " + cases.compare_line(term, estimate, truth[term]))
    g.section("your estimates beside rank 0's measurement", "\n".join(lines))
    for term, check in TERMS.items():
        bound = f"within {cases.ACTIVATIONS_TOLERANCE:.1%}" if term == "activations" else "exactly"
        if failed[check]:
            more = f" (and {len(failed[check]) - 1} more configurations)" if len(failed[check]) > 1 else ""
            g.record(check, False, failed[check][0] + more)
        else:
            g.record(check, True, f"{term} {bound} as measured in all {len(answers)} configurations")


def check_total(g: Grader, answers: list) -> None:
    if not any(isinstance(answer.get("value"), dict) for answer in answers):
        g.not_checked("total-is-sum", "params-measured", "training_memory answered no case")
        return
    for answer in answers:
        value = answer.get("value")
        if not isinstance(value, dict):
            continue
        if answer.get("nonfinite"):
            g.record("total-is-sum", False, f"training_memory {cases.error_of(answer)}")
            return
        parts = [value.get(t) for t in ("params", "grads", "optimizer", "activations")]
        total = value.get("total")
        if not all(isinstance(x, float) for x in parts + [total]) or abs(total - sum(parts)) > 1.0:
            g.record("total-is-sum", False, f"total {total!r} is not params + grads + optimizer + activations "
                                           f"= {sum(x for x in parts if isinstance(x, float)):,.0f}")
            return
    g.record("total-is-sum", True)


def check_zero_paper(g: Grader, answers: list) -> None:
    params = capacity.total_params(ZERO_MODEL)
    for (stage, figure), answer in zip(ZERO_FIGURE_GB.items(), answers):
        problem = cases.error_of(answer)
        if problem:
            g.record("zero-paper", False, f"ZeRO stage {stage}, 64 GPUs: training_memory {problem}")
            return
        value = answer["value"]
        states = sum(value.get(t, 0.0) for t in ("params", "grads", "optimizer")) / 1e9
        if abs(states - figure) > ZERO_TOLERANCE * figure:
            g.record("zero-paper", False,
                     f"{params / 1e9:.2f}B parameters on 64 GPUs, mixed-precision Adam, ZeRO stage {stage}: your "
                     f"params + grads + optimizer come to {states:.1f} GB per GPU; the ZeRO paper's figure 1 "
                     f"gives {figure} GB for 7.5B")
            return
    g.record("zero-paper", True, "120, 31.4, 16.6 and 1.9 GB per GPU for ZeRO stages 0-3, as in the paper")


def check_korthikanti(g: Grader, answers: dict) -> None:
    for (t, recompute), answer in answers.items():
        problem = cases.error_of(answer)
        expected = korthikanti(t, recompute)
        if problem:
            g.record("activations-paper", False, f"one layer, tp={t}, recompute={recompute!r}: {problem}")
            return
        estimate = answer["value"].get("activations")
        if not isinstance(estimate, float) or abs(estimate - expected) > cases.EXACT:
            g.record("activations-paper", False,
                     f"one GPT-3-sized layer (s=2048, b=1, h=12288, a=96) in 16-bit, tp={t}, recompute="
                     f"{recompute!r}: " + cases.compare_line("activations", estimate, expected).replace(
                         "measured", "by Korthikanti et al.'s table 2"))
            return
    g.record("activations-paper", True, "s b h (10 + 24/t + 5 a s / (h t)) bytes a layer, 34 + 5 a s / h at t = 1, "
                                        "the attention term gone under selective recomputation, 2 s b h under full")
