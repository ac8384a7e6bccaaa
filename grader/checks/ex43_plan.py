"""Exercise 43: choose_plan, graded under the kit's own cost model (the learner's function answers in
a worker; grader side: for each scenario the plan must be one the rules allow, fit in memory and be
within 10 % of the fastest plan, found by trying every plan; a scenario where nothing fits and a batch
that is not a whole number of sequences must be refused). The scenarios are where a search goes wrong:
one whose fastest plan has pipeline stages, one of 4-GPU nodes where tensor parallelism across two nodes
is the fastest plan the rules forbid, one whose 52 heads tp 8 does not divide. Nothing runs on ranks: the
cost model is held against measurement by 41's and 42's runs and by tests/test_capacity_measured.py."""

from __future__ import annotations

from grader import capacity
from grader import capacity_plans as plans
from grader.checks.interface import Grader
from grader.checks.shared import capacity_cases as cases
from grader.rank.drivers.ex43_plan import serve_main

# (41-43 share their rank side: the worker capacity_worker.estimates)

NEAR = 1.10  # at most 1.1 times the fastest plan's step time
NOTHING_FITS = ("405B on 64 GPUs", plans.GPT_405B, plans.on(plans.H100, 64), 2**20)
UNEVEN_BATCH = ("8B on 64 GPUs with half a sequence more", plans.GPT_8B, plans.on(plans.H100, 64), 4 * 2**20 + 4096)
PLAN_FIELDS = list(capacity.EXERCISE_FIELDS["Plan"])


def grade(g: Grader) -> None:
    scenarios = [(name, *scenario) for name, scenario in plans.SCENARIOS.items()]
    worker = g.worker(serve_main)
    try:
        answers = cases.ask(g, worker, "choose_plan",
                            [{"model": capacity.exercise_dict(model), "cluster": capacity.to_dict(cluster), "tokens": tokens}
                             for _, model, cluster, tokens in [*scenarios, NOTHING_FITS, UNEVEN_BATCH]])
    finally:
        worker.close()
    chosen = {}
    for (name, model, cluster, tokens), answer in zip(scenarios, answers):
        chosen[name] = check_allowed(g, name, model, cluster, tokens, answer)
    lines = []
    for name, model, cluster, tokens in scenarios:
        plan = chosen[name]
        if plan is not None:
            lines += compare_plans(name, model, cluster, tokens, plan)
    g.section("your plans beside the fastest", "\n".join(lines))
    allowed = [(name, model, cluster, tokens) for name, model, cluster, tokens in scenarios if chosen[name]]
    if not allowed:  # the plans the rules allow are costed; a plan they do not allow has failed already
        g.not_checked("plan-fits", "plan-allowed", "a plan the rules do not allow cannot be costed")
        g.not_checked("plan-near-fastest", "plan-allowed", "a plan the rules do not allow cannot be costed")
    else:
        check_fits(g, [(name, model, cluster, chosen[name]) for name, model, cluster, _ in allowed])
        check_near(g, [(name, model, cluster, tokens, chosen[name]) for name, model, cluster, tokens in allowed])
    check_refused(g, answers[-2])
    check_batch_refused(g, answers[-1])


def as_plan(value) -> capacity.Plan | None:
    if not isinstance(value, dict):
        return None
    fields = {}
    for name in PLAN_FIELDS:
        v = value.get(name)
        if name in ("schedule", "precision", "recompute"):
            if not isinstance(v, str):
                return None
            fields[name] = v
        else:
            if not isinstance(v, float) or v != int(v):
                return None
            fields[name] = int(v)
    return capacity.Plan(**fields)


def check_allowed(g: Grader, name: str, model, cluster, tokens: int, answer: dict) -> capacity.Plan | None:
    problem = cases.error_of(answer)
    if problem:
        g.record("plan-allowed", False, f"{name}: choose_plan {problem}")
        return None
    plan = as_plan(answer["value"])
    if plan is None:
        g.record("plan-allowed", False, f"{name}: choose_plan returned {answer['value']!r}, not a Plan")
        return None
    if plan not in set(plans.candidate_plans(model, cluster, tokens)):
        why = why_not_allowed(model, cluster, tokens, plan)
        g.record("plan-allowed", False, f"{name}: {cases.describe(plan)} is not among the plans allowed: {why}")
        return None
    g.record("plan-allowed", True, f"{name}: {cases.describe(plan)}")
    return plan


def why_not_allowed(model, cluster, tokens: int, plan: capacity.Plan) -> str:
    try:
        capacity.validate(model, plan, cluster.gpus)
    except capacity.PlanError as exc:
        return str(exc)
    refusal = plans.exercise_refusal(model, plan)
    if refusal:
        return refusal
    sequences = plan.dp * plan.micro_batches * plan.micro_batch
    if sequences * model.seq_len != tokens:
        return (f"dp x micro_batches x micro_batch = {sequences} sequences of {model.seq_len} tokens, "
                f"not the global batch of {tokens:,} tokens")
    if plan.precision != "bf16-mixed":
        return "precision must be bf16-mixed"
    if plan.tp not in plans.TENSOR_PARALLEL or plan.tp > cluster.gpus_per_node:
        across = f": tp {plan.tp} spans {plan.tp // cluster.gpus_per_node} nodes" if plan.tp > cluster.gpus_per_node else ""
        return f"tp must be 1, 2, 4 or 8 and at most {cluster.gpus_per_node} (one node){across}"
    return f"micro_batch must be one of {', '.join(map(str, plans.MICRO_BATCHES))}"


def compare_plans(name: str, model, cluster, tokens: int, plan: capacity.Plan) -> list[str]:
    best = plans.best_plan(model, cluster, tokens)
    lines = [f"{name}:"]
    for who, p in (("yours", plan), ("fastest", best)):
        if p is None:
            continue
        memory, time = capacity.training_memory(model, p), capacity.step_time(model, p, cluster)
        lines.append(f"  {who:8} {cases.describe(p)}: {memory.total / 1e9:.1f} GB, {time.total_s:.2f} s a step; "
                     f"limited by {'; '.join(plans.limits(model, p, cluster))}")
    return lines


def check_fits(g: Grader, chosen: list) -> None:
    for name, model, cluster, plan in chosen:
        memory = capacity.training_memory(model, plan)
        if memory.total > cluster.memory_bytes:
            g.record("plan-fits", False,
                     f"{name}: {cases.describe(plan)} needs {memory.total / 1e9:.1f} GB per GPU (params "
                     f"{memory.params / 1e9:.1f}, grads {memory.grads / 1e9:.1f}, optimizer {memory.optimizer / 1e9:.1f}, "
                     f"activations {memory.activations / 1e9:.1f}), more than {cluster.memory_bytes / 1e9:.0f} GB")
            return
    g.record("plan-fits", True, f"each plan the rules allow fits in {plans.H100.memory_bytes / 1e9:.0f} GB per GPU "
                                f"({len(chosen)} scenarios)")


def check_near(g: Grader, chosen: list) -> None:
    for name, model, cluster, tokens, plan in chosen:
        best = plans.best_plan(model, cluster, tokens)
        mine, fastest = capacity.step_time(model, plan, cluster).total_s, capacity.step_time(model, best, cluster).total_s
        if mine > NEAR * fastest:
            g.record("plan-near-fastest", False,
                     f"{name}: {cases.describe(plan)} takes {mine:.2f} s a step, {mine / fastest:.2f} x the fastest "
                     f"plan's {fastest:.2f} s ({cases.describe(best)}); limited by "
                     f"{'; '.join(plans.limits(model, plan, cluster))}")
            return
    g.record("plan-near-fastest", True, f"each plan the rules allow within 10 % of the fastest ({len(chosen)} scenarios)")


def check_refused(g: Grader, answer: dict) -> None:
    name = NOTHING_FITS[0]
    if answer.get("value_error"):
        g.record("nothing-fits-refused", True, f"{name}: {answer['error']}")
    elif "error" in answer:
        g.record("nothing-fits-refused", False, f"{name}: choose_plan raised {answer['error']}, not ValueError")
    else:
        g.record("nothing-fits-refused", False,
                 f"{name} (16 bytes a parameter alone is {16 * capacity.total_params(NOTHING_FITS[1]) / 64 / 1e9:.0f} "
                 f"GB per GPU): choose_plan returned {answer.get('value')!r} instead of raising ValueError")


def check_batch_refused(g: Grader, answer: dict) -> None:
    name, model, _, tokens = UNEVEN_BATCH
    if answer.get("value_error"):
        g.record("uneven-batch-refused", True, f"{name}: {answer['error']}")
    elif "error" in answer:
        g.record("uneven-batch-refused", False, f"{name}: choose_plan raised {answer['error']}, not ValueError")
    else:
        g.record("uneven-batch-refused", False,
                 f"{name}: {tokens:,} tokens are {tokens / model.seq_len:.2f} sequences of {model.seq_len:,}; "
                 f"choose_plan returned {answer.get('value')!r} instead of raising ValueError")
