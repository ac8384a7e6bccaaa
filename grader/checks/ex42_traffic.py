"""Exercise 42: communication and step_time, graded against measurement (rank side: the kit's runs
of :mod:`.shared.capacity_run` record every collective rank 0 makes and the FLOPs it computes; the
learner's functions answer in a worker; grader side: bytes per dimension and collective against the
collectives seen, FLOPs against FlopCounterMode, then the ring's 2(n-1)/n, GPipe's bubble and every
field of a step against the kit's cost model at scale, then the refusals)."""

from __future__ import annotations

from grader import capacity
from grader import capacity_plans
from grader.checks.interface import Grader
from grader.checks.shared import capacity_cases as cases
from grader.rank.drivers.ex42_traffic import measure_main, serve_main

# (41-43 share their rank side: the measured runs, capacity_run.measure_main; the worker, capacity_worker.estimates)

TIME_TOLERANCE = 1e-6  # relative: the same formula in another order of operations
BIG = capacity_plans.SCENARIOS["70B on 1,024 GPUs"][0]
RING_SIZES = (2, 8, 64, 1024)
BUBBLES = ((4, 8), (8, 4), (2, 16), (16, 2))  # (stages, micro-batches), each dividing BIG's 80 layers


def at_scale() -> list:
    """(name, model, plan, cluster): plans that reach every term of a step at scale."""
    model, h100 = BIG, capacity_plans.H100
    plans = {
        "data parallel, ZeRO 1, 64 GPUs": capacity.Plan(dp=64, zero=1, micro_batches=4, recompute="full"),
        "FSDP-like, 1,024 GPUs": capacity.Plan(dp=128, tp=8, zero=3, micro_batches=4, recompute="selective"),
        "tensor parallel across nodes": capacity.Plan(dp=8, tp=8, pp=2, zero=1, micro_batches=8,
                                                      recompute="full"),
        "3-D, 1,024 GPUs": capacity.Plan(dp=16, tp=8, pp=8, zero=1, micro_batch=2, micro_batches=16),
        "pipeline, few micro-batches": capacity.Plan(dp=4, tp=4, pp=16, zero=0, micro_batches=4, schedule="gpipe"),
        "fp32, 16 GPUs": capacity.Plan(dp=4, tp=4, pp=1, zero=2, micro_batches=2, precision="fp32"),
    }
    out = []
    for name, plan in plans.items():
        cluster = capacity_plans.on(h100, plan.world_size)
        if name == "tensor parallel across nodes":
            cluster = capacity.Cluster(**{**capacity.to_dict(cluster), "gpus_per_node": 4})
        out.append((name, model, plan, cluster))
    return out


def h100s(gpus: int) -> capacity.Cluster:
    return capacity_plans.on(capacity_plans.H100, gpus)


def with_cluster(model, plan, cluster) -> dict:
    return {**cases.plain(model, plan), "cluster": capacity.to_dict(cluster)}


BAD = {
    "dp x tp x pp = 8 on a 16-GPU cluster": (capacity.Plan(dp=8), 16),
    "3 pipeline stages for 4 layers": (capacity.Plan(pp=3), 3),
    "ZeRO 2 with 2 pipeline stages": (capacity.Plan(dp=2, pp=2, zero=2), 4),
}


def grade(g: Grader) -> None:
    configs = list(cases.CONFIGS.values())
    scale = at_scale()
    rings = [capacity.Plan(dp=n, zero=0) for n in RING_SIZES]
    bubbles = [capacity.Plan(pp=p, micro_batches=m) for p, m in BUBBLES]
    worker = g.worker(serve_main)
    try:
        traffic = cases.ask(g, worker, "communication", [cases.plain(cases.SMALL, p) for p in configs])
        flops = cases.ask(g, worker, "step_time", [with_cluster(cases.SMALL, p, h100s(p.world_size))
                                                   for p in configs])
        ring = cases.ask(g, worker, "communication", [cases.plain(BIG, p) for p in rings])
        bubble = cases.ask(g, worker, "step_time", [with_cluster(BIG, p, h100s(p.world_size))
                                                    for p in bubbles])
        times = cases.ask(g, worker, "step_time", [with_cluster(*case[1:]) for case in scale])
        bad = cases.ask(g, worker, "step_time", [with_cluster(cases.SMALL, plan, h100s(gpus))
                                                 for plan, gpus in BAD.values()])
    finally:
        worker.close()
    records = cases.measured(g, measure_main)
    check_traffic(g, dict(zip(cases.CONFIGS, traffic)), records)
    check_flops(g, dict(zip(cases.CONFIGS, flops)), records)
    check_ring(g, list(zip(rings, ring)))
    check_bubble(g, list(zip(bubbles, bubble)))
    check_step_time(g, list(zip(scale, times)))
    cases.check_refusals(g, "step_time", dict(zip(BAD, bad)))


def measured_traffic(record: dict, plan: capacity.Plan) -> dict:
    """(dimension, collective) -> bytes rank 0 sends, from the collectives it made (ring model)."""
    sizes = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp}
    out: dict = {}
    for dimension, name, payload in record["collectives"]:
        if dimension in sizes and name in capacity.COLLECTIVES:
            key = (dimension, name)
            out[key] = out.get(key, 0.0) + payload * capacity.ring_factor(name, sizes[dimension])
    return {k: v for k, v in out.items() if v}


def estimated_traffic(value: dict) -> dict:
    out = {}
    for dimension in capacity.DIMENSIONS:
        for name, sent in (value.get(dimension) or {}).items():
            if sent:
                out[(dimension, str(name))] = sent
    return out


def check_traffic(g: Grader, answers: dict, records: dict) -> None:
    lines, failures = [], []
    for name, answer in answers.items():
        plan = cases.CONFIGS[name]
        problem = cases.error_of(answer)
        if problem:
            failures.append(f"{name}, {cases.describe(plan)}: communication {problem}")
            continue
        truth, estimate = measured_traffic(records[name][0], plan), estimated_traffic(answer["value"])
        lines.append(f"{name} ({cases.describe(plan)}), rank 0 sends per step:")
        for key in sorted(set(truth) | set(estimate)):
            said = estimate.get(key, 0.0)
            line = cases.compare_line(f"{key[0]} {key[1]}", said, truth.get(key, 0.0))
            lines.append("  " + line)
            if not isinstance(said, (int, float)) or abs(said - truth.get(key, 0.0)) > cases.EXACT:
                failures.append(f"{name}, {cases.describe(plan)}: {line}")
    g.section("your traffic beside the collectives rank 0 made", "\n".join(lines))
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        g.record("traffic-measured", False, failures[0] + more)
    else:
        g.record("traffic-measured", True, f"every collective's bytes as measured in all {len(answers)} configurations")


def check_flops(g: Grader, answers: dict, records: dict) -> None:
    """Every configuration is judged: the message shows the first wrong one and says how many others are."""
    failures = []
    for name, answer in answers.items():
        problem = cases.error_of(answer)
        truth = records[name][0]["flops"]
        plan = cases.describe(cases.CONFIGS[name])
        if problem:
            failures.append(f"{name}, {plan}: step_time {problem}")
            continue
        estimate = answer["value"].get("flops")
        if not isinstance(estimate, float) or abs(estimate - truth) > cases.EXACT:
            failures.append(f"{name}, {plan}: " + cases.compare_line("FLOPs", estimate, truth, "FLOPs")
                            .replace("measured", "counted by FlopCounterMode"))
    if failures:
        more = f" (and {len(failures) - 1} more of the {len(answers)} configurations)" if len(failures) > 1 else ""
        g.record("flops-measured", False, failures[0] + more)
        return
    g.record("flops-measured", True, f"FLOPs as FlopCounterMode counted them in all {len(answers)} configurations")


def check_ring(g: Grader, answers: list) -> None:
    grad_bytes = 2 * capacity.total_params(BIG)
    for plan, answer in answers:
        problem = cases.error_of(answer)
        if problem:
            g.record("ring-factor", False, f"{cases.describe(plan)}: communication {problem}")
            return
        sent = sum((answer["value"].get("dp") or {}).values()) if isinstance(answer["value"].get("dp"), dict) else 0
        share, expected = sent / grad_bytes, 2 * (plan.dp - 1) / plan.dp
        if abs(share - expected) > 1e-6:
            g.record("ring-factor", False,
                     f"{plan.dp} data-parallel ranks, ZeRO 0: each rank sends {share:.4f} x its gradients' bytes; "
                     f"a ring all-reduce sends 2(n-1)/n = {expected:.4f}")
            return
    g.record("ring-factor", True, "2(n-1)/n of the gradients per rank for n = " + ", ".join(map(str, RING_SIZES)))


def check_bubble(g: Grader, answers: list) -> None:
    for plan, answer in answers:
        problem = cases.error_of(answer)
        if problem:
            g.record("bubble", False, f"{cases.describe(plan)}: step_time {problem}")
            return
        value = answer["value"]
        pipelined = value.get("total_s", 0.0) - value.get("exposed_dp_s", 0.0)
        share = value.get("bubble_s", 0.0) / pipelined if pipelined else 0.0
        p, m = plan.pp, plan.micro_batches
        expected = (p - 1) / (m + p - 1)
        if abs(share - expected) > 1e-6:
            g.record("bubble", False,
                     f"{p} stages, {m} micro-batches: your bubble is {share:.1%} of the step; GPipe's is "
                     f"(p-1)/(m+p-1) = {expected:.1%}")
            return
    g.record("bubble", True, "(p-1)/(m+p-1) of the step for " +
             ", ".join(f"p={p}, m={m}" for p, m in BUBBLES))


def check_step_time(g: Grader, answers: list) -> None:
    lines, first = [], None
    for (name, model, plan, cluster), answer in answers:
        problem = cases.error_of(answer)
        if problem:
            first = first or f"{name}: step_time {problem}"
            continue
        reference = capacity.exercise_dict(capacity.step_time(model, plan, cluster))
        lines.append(f"{name} ({cases.describe(plan)}):")
        for term, truth in reference.items():
            said = answer["value"].get(term)
            ok = isinstance(said, float) and abs(said - truth) <= TIME_TOLERANCE * max(abs(truth), 1e-12)
            shown = f"{said:.4g}" if isinstance(said, float) else repr(said)
            lines.append(f"  {term}: {shown} yours, {truth:.4g} the kit's model" + ("" if ok else "  <-"))
            if not ok and first is None:
                first = f"{name} ({cases.describe(plan)}): {term} {shown}, the kit's model gives {truth:.4g}"
    g.section("your step times beside the kit's cost model", "\n".join(lines))
    g.record("step-time-model", first is None, first or f"every term of {len(answers)} plans at scale")
