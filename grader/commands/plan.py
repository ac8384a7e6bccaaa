"""``ddp-grade plan``: ask the kit's cost model (:mod:`grader.capacity`) about a parallel training plan.

A plan of one's own is answered once exercises 41 (memory) and 42 (traffic and time) have passed: before
that, the learner would be shown the answers they are writing. The published runs (``--published``) are
answered at once: they are the papers' figures beside the kit's. Four ways to ask:

* a plan: the model (``--layers`` ... ``--seq-len``, and a frontier model's options), the plan (``--dp``
  ... ``--recompute``, and the frontier plan's options) and the cluster (``--gpu H100`` or ``A100``, as
  many GPUs as the plan uses);
* ``--best``: the fastest plan that fits for the model, ``--gpus`` and ``--global-batch-tokens``, searched
  by the kit's planner (``--search kit``, :func:`grader.capacity_plans.planner_plans`) or by 43's rules;
* ``--scenario NAME``: one of 43's scenarios (searched by 43's rules) or of the planner's (with the plan
  the scenario's paper published beside the pick), its best plan or the plan given;
* ``--published``: every published figure the model is held to (grader/capacity_published.py), each with
  the command that reproduces it.

The numbers come from grader.capacity as plain data (``evaluate``, ``answer_for``); plan_text puts them into
words, and the command (:mod:`grader.cli.plan`) exits 0 when the cost model answered (also "does not fit"
and "no plan fits": that is the answer), 1 while 41 and 42 have not both passed (a plan of one's own), 2 for
input the cost model cannot use (a PlanError).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, fields, replace

from grader import capacity
from grader import capacity_plans as plans
from grader import capacity_published as published
from grader import capacity_speed as speed
from grader.progress import Progress

REQUIRES = ("41", "42")  # the exercises whose answers this command shows
MODEL_OPTIONS = tuple(f.name for f in fields(capacity.ModelSpec))
PLAN_OPTIONS = tuple(f.name for f in fields(capacity.Plan))
REQUIRED_MODEL = capacity.EXERCISE_FIELDS["ModelSpec"]
GB = 1e9  # decimal, as capacity's own messages and the H100's 80 GB


# --- the lock ---------------------------------------------------------------------------------------


def refusal(progress: Progress) -> str | None:
    """The one line that refuses the command while an exercise of REQUIRES has not passed; None once all have."""
    states = [(ex, progress.passed(ex)) for ex in REQUIRES]
    if all(passed for _, passed in states):
        return None
    said = "; ".join(f"{ex}: {'passed' if passed else 'not passed yet'}" for ex, passed in states)
    return f"ddp-grade plan opens once {' and '.join(REQUIRES)} pass ({said})"


# --- input ------------------------------------------------------------------------------------------


def find_scenario(name: str) -> str:
    """The key of 43's or the planner's scenarios that ``name`` means: the name itself, in any case, with or
    without the thousands comma ("70b on 1024 gpus"), or its model alone ("70B")."""
    def norm(text: str) -> str:
        return re.sub(r"[\s,]+", "", text.lower())

    for key in [*plans.SCENARIOS, *plans.FRONTIER]:
        if norm(name) in (norm(key), norm(key.split()[0])):
            return key
    known = "; ".join(f'"{key}"' for key in [*plans.SCENARIOS, *plans.FRONTIER])
    raise capacity.PlanError(f"no scenario {name!r}; the scenarios: {known}")


CLUSTER_OPTIONS = {  # option: (Cluster field, factor from the option's unit, the least value allowed, inclusive)
    "gpus_per_node": ("gpus_per_node", 1, (1, True)), "peak_tflops": ("peak_flops", 1e12, (0, False)),
    "mfu": ("mfu", 1, (0, False)), "memory_gb": ("memory_bytes", GB, (0, False)),
    "intra_gbps": ("intra_node_bandwidth", GB, (0, False)), "inter_gbps": ("inter_node_bandwidth", GB, (0, False)),
    "intra_latency_us": ("intra_node_latency", 1e-6, (0, True)),
    "inter_latency_us": ("inter_node_latency", 1e-6, (0, True)),
}


FLAGS = {"mfu": "--compute-efficiency"}  # options whose flag is not the field's name


def make_cluster(base: capacity.Cluster, given: dict, gpus: int) -> capacity.Cluster:
    """``base`` with what the command line gave (in its units: TFLOP/s, GB, GB/s, microseconds); PlanError
    for a value the cost model cannot use (capacity.validate checks the model and the plan only)."""
    if gpus < 1:
        raise capacity.PlanError(f"--gpus must be at least 1, not {gpus}")
    changes = {}
    for option, (name, factor, (least, inclusive)) in CLUSTER_OPTIONS.items():
        value = given.get(option)
        if value is None:
            continue
        if not math.isfinite(value) or not (value >= least if inclusive else value > least):
            flag = FLAGS.get(option, "--" + option.replace("_", "-"))
            bound = f"{'at least' if inclusive else 'above'} {least}"
            raise capacity.PlanError(f"{flag} must be a number {bound}, not {value:g}")
        changes[name] = value * factor
    if given.get("mfu") is not None and given["mfu"] > 1:
        raise capacity.PlanError(f"--compute-efficiency is the fraction of peak every FLOP runs at, at most 1, "
                                 f"not {given['mfu']:g}")
    return replace(base, gpus=gpus, **changes)


def parse_layers(text: str) -> tuple:
    """``--stage-layers``: counts separated by commas, ``NxK`` for N repeated K times ("0,1x126,0")."""
    out = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:x\s*(\d+))?\s*", item)
        if not match:
            raise capacity.PlanError(f"--stage-layers takes counts like 8,8 or 0,1x126,0, not {text!r}")
        out += [int(match[1])] * int(match[2] or 1)
    return tuple(out)


def plan_tokens(model: capacity.ModelSpec, plan: capacity.Plan) -> int:
    """Tokens of one optimizer step over every data-parallel rank."""
    return plan.dp * plan.micro_batch * plan.micro_batches * model.seq_len


# --- the answer, as plain data ---------------------------------------------------------------------------


def evaluate(model: capacity.ModelSpec, plan: capacity.Plan, cluster: capacity.Cluster, flat: bool = False) -> dict:
    """Everything the cost model says of ``plan`` (rank 0's figures; bytes, seconds, FLOPs), and the step
    as throughput (MFU and TFLOP/s per GPU over every GPU). The step is the kit's (capacity_speed) for a
    GPU kind it knows, 42's (every FLOP at ``cluster.mfu``) when ``flat`` or for another."""
    capacity.validate(model, plan, cluster.gpus)
    memory = capacity.training_memory(model, plan)
    traffic = capacity.communication(model, plan)
    timer = plans.timer_for(cluster, flat)
    kind = plans.gpu_kind(cluster)
    if timer is capacity.step_time:
        time = capacity.step_time(model, plan, cluster)
        compute = {"model": "42", "efficiency": cluster.mfu}
    else:
        parts = speed.breakdown(model, plan, cluster, kind)
        time = parts.step
        compute = {"model": "kit", "matmul_s": parts.matmul_s, "attention_s": parts.attention_s,
                   "memory_s": parts.memory_s, "hidden_tp_s": parts.hidden_tp_s, "straggler_s": parts.straggler_s}
    rates = plans.utilisation(model, plan, cluster, time)
    return {
        "plan": asdict(plan),
        "global_batch_tokens": plan_tokens(model, plan),
        "memory": {**capacity.to_dict(memory), "model_states": memory.params + memory.grads + memory.optimizer,
                   "capacity": cluster.memory_bytes, "fits": plans.fits(model, plan, cluster)},
        "traffic": {**{d: dict(getattr(traffic, d)) for d in capacity.DIMENSIONS}, "total": traffic.total()},
        "step_time": capacity.to_dict(time),
        "compute": compute,
        "tokens_per_s_per_gpu": rates["tokens_per_s_per_gpu"],
        "mfu": rates["mfu"],
        "tflops_per_gpu": rates["tflops_per_gpu"],
        "limits": plans.limits(model, plan, cluster, timer),
    }


def search(model: capacity.ModelSpec, cluster: capacity.Cluster, global_batch_tokens: int, rules: str,
           known: capacity.Plan | None = None, flat: bool = False) -> dict:
    """The best plan of 43's search (rules "43", under 42's step time) or the planner's ("kit", under the
    kit's), evaluated; ``plan`` None (and ``why``) when none fits. ``known``: a published plan of this
    scenario, evaluated beside the pick."""
    capacity.validate(model, capacity.Plan())
    if global_batch_tokens < 1:
        raise capacity.PlanError(f"--global-batch-tokens must be at least 1, not {global_batch_tokens}")
    flat = flat or rules == "43"
    space = plans.candidate_plans if rules == "43" else plans.planner_plans
    searched = sum(1 for _ in space(model, cluster, global_batch_tokens)) + (known is not None)
    best = plans.best_plan(model, cluster, global_batch_tokens) if rules == "43" else \
        plans.best_frontier(model, cluster, global_batch_tokens, known, flat)
    found = {"searched": searched, "search": rules, "requested_global_batch_tokens": global_batch_tokens}
    if known is not None:
        found["published_plan"] = {**evaluate(model, known, cluster, flat), "source": published.LLAMA,
                                   "why": plans.why_differ(model, cluster, best, known,
                                                           timer=plans.timer_for(cluster, flat)) if best else None}
    if best is not None:
        return {**found, **evaluate(model, best, cluster, flat)}
    if searched == 0:
        why = (f"no plan of the search splits {global_batch_tokens:,} tokens ({global_batch_tokens // model.seq_len:,} "
               f"sequences) and {model.layers} layers over {cluster.gpus:,} GPUs")
    else:
        why = f"none of the {searched:,} plans searched fits in {cluster.memory_bytes / GB:g} GB per GPU"
    return {**found, "plan": None, "why": why}


def answer(model: capacity.ModelSpec, cluster: capacity.Cluster, result: dict, scenario: str | None) -> dict:
    """The whole answer: what was asked (model, cluster, scenario) and what the cost model said."""
    return {"scenario": scenario, "model": asdict(model), "parameters": capacity.total_params(model),
            "gpu": plans.gpu_kind(cluster), "cluster": asdict(cluster), **result}


def at_path(data: dict, path: str):
    """The field of ``data`` at a dotted path ("memory.activations")."""
    for part in path.split("."):
        data = data[part]
    return data


def command_of(row: published.Row) -> str:
    """The `ddp-grade plan ... --json` command line that answers with ``row``'s plan (a formula's row: on the
    default GPU kind, whose figure the formula's does not depend on)."""
    words = ["ddp-grade plan"]
    for f in fields(capacity.ModelSpec):
        value = getattr(row.model, f.name)
        if f.name in REQUIRED_MODEL or value != f.default:
            words.append(_flag(f.name, value))
    for f in fields(capacity.Plan):
        value = getattr(row.plan, f.name)
        if value != f.default:
            words.append(_flag(f.name, value))
    return " ".join([*words, *([f"--gpu {row.gpu}"] if row.gpu else []), "--json"])


def _flag(name: str, value) -> str:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{name.replace('_', '-')}"
    if isinstance(value, tuple):
        return f"{flag} {_layers_text(value)}"
    return f"{flag} {value}"


def _layers_text(counts: tuple) -> str:
    runs: list = []
    for n in counts:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ",".join(f"{n}x{k}" if k > 1 else str(n) for n, k in runs)


def published_rows() -> list[dict]:
    """Every published row beside the kit's figure, each from ``evaluate`` as a plan of its own, with its group
    (fit, formula, held-out)."""
    out = []
    for row in published.ROWS:
        data = evaluate(row.model, row.plan, published.cluster_of(row))
        kit = float(at_path(data, row.metric))
        out.append({"group": row.group, "source": row.source, "row": row.row, "metric": row.metric, "unit": row.unit,
                    "published": row.published, "kit": kit, "ratio": kit / row.published, "gpu": row.gpu,
                    "memory_bytes": data["memory"]["total"], "fits": data["memory"]["fits"],
                    "checks_memory": "fits" in row.checks, "note": "; ".join(n for n in (row.note, published.READINGS[row.source]) if n),
                    "command": command_of(row)})
    return out


def summary(rows: list[dict]) -> dict:
    """What ``published_rows`` shows, in figures: the fitted constants and what they were fitted to, and the
    error (rms of log kit / published) and worst ratios of the fitted and the held-out rows."""
    def error(group: str) -> dict:
        ratios = [row["ratio"] for row in rows if row["group"] == group]
        return {"rows": len(ratios), "rms": math.sqrt(sum(math.log(r) ** 2 for r in ratios) / len(ratios)),
                "lowest": min(ratios), "highest": max(ratios)}

    constants = speed.FITTED
    return {"fitted": {"k0": constants.k0, "link_efficiency": constants.link_efficiency},
            "measured": {"sustained": constants.sustained, "jitter": constants.jitter},
            "fit": error("fit"), "held_out": error("held-out"),
            "formula_exact": sum(row["group"] == "formula" for row in rows)}


# --- the command line's question, answered ----------------------------------------------------------------


def _given(values: dict, names) -> list[str]:
    return ["--" + name.replace("_", "-") for name in names if values.get(name) is not None]


def check_only_published(scenario, best, given: dict) -> None:
    others = _given(given, [*MODEL_OPTIONS, *PLAN_OPTIONS, "no_dp_overlap", "no_tp_overlap"]) + (["--scenario"] if scenario else []) + \
        (["--best"] if best else [])
    if others:
        raise capacity.PlanError(f"--published shows the published rows: leave out {', '.join(others)}")


def normalised(given: dict) -> dict:
    """The command line's values as the dataclasses' fields (--no-dp-overlap as dp_overlap, layers parsed)."""
    out = dict(given)
    if out.pop("no_dp_overlap", None):
        out["dp_overlap"] = False
    if out.pop("no_tp_overlap", None):
        out["tp_overlap"] = False
    if out.get("stage_layers") is not None:
        out["stage_layers"] = parse_layers(out["stage_layers"])
    return out


def answer_for(scenario, best, rules, global_batch_tokens, gpu, gpus, given: dict) -> dict:
    """What the command line asks, answered as plain data; PlanError for input that cannot be used. The step is
    the kit's unless --compute-efficiency sets 42's one efficiency for every FLOP."""
    plan_given = _given(given, PLAN_OPTIONS)
    base = plans.GPU_KINDS[gpu or "H100"]
    flat = given.get("mfu") is not None
    if best and plan_given:
        raise capacity.PlanError(f"--best searches the plan: leave out {', '.join(plan_given)}")
    if scenario is not None:
        if _given(given, MODEL_OPTIONS):
            raise capacity.PlanError(f"--scenario sets the model: leave out {', '.join(_given(given, MODEL_OPTIONS))}")
        name = find_scenario(scenario)
        model, cluster, tokens = {**plans.SCENARIOS, **plans.FRONTIER}[name]
        tokens = global_batch_tokens if global_batch_tokens is not None else tokens
        cluster = make_cluster(replace(base, gpus=cluster.gpus) if gpu else cluster, given,
                               gpus if gpus is not None else cluster.gpus)
        if best or not plan_given:
            default = "43" if name in plans.SCENARIOS else "kit"
            known = _published_plan(name, model, cluster, tokens)
            return answer(model, cluster, search(model, cluster, tokens, rules or default, known, flat), name)
        return answer(model, cluster, _one_plan(model, cluster, given, global_batch_tokens, flat), name)
    missing = [o for o in REQUIRED_MODEL if given.get(o) is None]
    if missing:
        raise capacity.PlanError(f"the model needs {', '.join('--' + o.replace('_', '-') for o in missing)} "
                                 f"(or --scenario NAME)")
    model = capacity.ModelSpec(**{o: given[o] for o in MODEL_OPTIONS if given.get(o) is not None})
    if best:
        if gpus is None or global_batch_tokens is None:
            raise capacity.PlanError("--best needs --gpus and --global-batch-tokens")
        cluster = make_cluster(base, given, gpus)
        return answer(model, cluster, search(model, cluster, global_batch_tokens, rules or "kit", flat=flat), None)
    plan = _plan_of(given)
    cluster = make_cluster(base, given, gpus if gpus is not None else max(plan.world_size, 1))
    return answer(model, cluster, _one_plan(model, cluster, given, global_batch_tokens, flat), None)


def _published_plan(name: str, model, cluster, tokens: int) -> capacity.Plan | None:
    """The plan a paper published for this scenario's model, cluster and batch, if any."""
    for row in published.LLAMA_ROWS:
        if row.model == model and row.plan.world_size == cluster.gpus and plan_tokens(model, row.plan) == tokens:
            return row.plan
    return None


def _plan_of(given: dict) -> capacity.Plan:
    return capacity.Plan(**{o: given[o] for o in PLAN_OPTIONS if given.get(o) is not None})


def _one_plan(model, cluster, given: dict, global_batch_tokens: int | None, flat: bool = False) -> dict:
    plan = _plan_of(given)
    capacity.validate(model, plan, cluster.gpus)
    if global_batch_tokens is not None and plan_tokens(model, plan) != global_batch_tokens:
        raise capacity.PlanError(
            f"dp x micro-batch x micro-batches x seq-len = {plan.dp} x {plan.micro_batch} x {plan.micro_batches} x "
            f"{model.seq_len} = {plan_tokens(model, plan):,} tokens, not the global batch {global_batch_tokens:,}")
    return evaluate(model, plan, cluster, flat)
