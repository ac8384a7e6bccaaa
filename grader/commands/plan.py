"""``ddp-grade plan``: ask the kit's cost model (:mod:`grader.capacity`) about a parallel training plan.

It opens once exercises 41 (memory) and 42 (traffic and time) have passed: before that, the learner
would be shown the answers they are writing. Three ways to ask:

* a plan: the model (``--layers`` ... ``--seq-len``), the plan (``--dp`` ... ``--recompute``) and the
  cluster (H100 by default, as many GPUs as the plan uses);
* ``--best``: the fastest plan that fits, searched exhaustively for the model, ``--gpus`` and
  ``--global-batch-tokens`` (the search of exercise 43, ``capacity.best_plan``);
* ``--scenario NAME``: one of ``capacity.SCENARIOS`` (model, cluster, global batch), its best plan, or
  the plan given on the command line.

The numbers come from grader.capacity as plain data (``evaluate``); this module alone puts them into
words. Exit codes: 0 the cost model answered (also "does not fit" and "no plan fits": that is the
answer), 1 refused while 41 and 42 have not both passed, 2 input the cost model cannot use.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, replace

import click

from grader import capacity
from grader.exits import EXIT_FAILED, EXIT_OK, EXIT_UNUSABLE
from grader.progress import Progress

REQUIRES = ("41", "42")  # the exercises whose answers this command shows
MODEL_OPTIONS = ("layers", "hidden", "heads", "vocab", "seq_len")
PLAN_OPTIONS = ("dp", "tp", "pp", "zero", "micro_batch", "micro_batches", "schedule", "precision", "recompute")
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
    """The key of capacity.SCENARIOS that ``name`` means: the name itself, in any case, with or without
    the thousands comma ("70b on 1024 gpus"), or its model alone ("70B")."""
    def norm(text: str) -> str:
        return re.sub(r"[\s,]+", "", text.lower())

    for key in capacity.SCENARIOS:
        if norm(name) in (norm(key), norm(key.split()[0])):
            return key
    known = "; ".join(f'"{key}"' for key in capacity.SCENARIOS)
    raise capacity.PlanError(f"no scenario {name!r}; the scenarios: {known}")


CLUSTER_OPTIONS = {  # option: (Cluster field, factor from the option's unit, the least value allowed, inclusive)
    "gpus_per_node": ("gpus_per_node", 1, (1, True)), "peak_tflops": ("peak_flops", 1e12, (0, False)),
    "mfu": ("mfu", 1, (0, False)), "memory_gb": ("memory_bytes", GB, (0, False)),
    "intra_gbps": ("intra_node_bandwidth", GB, (0, False)), "inter_gbps": ("inter_node_bandwidth", GB, (0, False)),
    "intra_latency_us": ("intra_node_latency", 1e-6, (0, True)),
    "inter_latency_us": ("inter_node_latency", 1e-6, (0, True)),
}


def make_cluster(base: capacity.Cluster, given: dict, gpus: int) -> capacity.Cluster:
    """``base`` with what the command line gave (in its units: TFLOP/s, GB, GB/s, microseconds); PlanError
    for a value the cost model cannot use (capacity.validate checks the model and the plan only)."""
    if gpus < 1:
        raise capacity.PlanError(f"--gpus must be at least 1, not {gpus}")
    changes = {}
    for option, (field, factor, (least, inclusive)) in CLUSTER_OPTIONS.items():
        value = given.get(option)
        if value is None:
            continue
        if not math.isfinite(value) or not (value >= least if inclusive else value > least):
            flag = "--" + option.replace("_", "-")
            bound = f"{'at least' if inclusive else 'above'} {least}"
            raise capacity.PlanError(f"{flag} must be a number {bound}, not {value:g}")
        changes[field] = value * factor
    if given.get("mfu") is not None and given["mfu"] > 1:
        raise capacity.PlanError(f"--mfu is the fraction of peak compute achieved, at most 1, not {given['mfu']:g}")
    return replace(base, gpus=gpus, **changes)


def plan_tokens(model: capacity.ModelSpec, plan: capacity.Plan) -> int:
    """Tokens of one optimizer step over every data-parallel rank."""
    return plan.dp * plan.micro_batch * plan.micro_batches * model.seq_len


# --- the answer, as plain data ---------------------------------------------------------------------------


def evaluate(model: capacity.ModelSpec, plan: capacity.Plan, cluster: capacity.Cluster) -> dict:
    """Everything the cost model says of ``plan`` (rank 0's figures; bytes, seconds, FLOPs)."""
    capacity.validate(model, plan, cluster.gpus)
    memory = capacity.training_memory(model, plan)
    traffic = capacity.communication(model, plan)
    time = capacity.step_time(model, plan, cluster)
    tokens = plan_tokens(model, plan)
    return {
        "plan": asdict(plan),
        "global_batch_tokens": tokens,
        "memory": {**capacity.to_dict(memory), "capacity": cluster.memory_bytes,
                   "fits": capacity.fits(model, plan, cluster)},
        "traffic": {"dp": dict(traffic.dp), "tp": dict(traffic.tp), "pp": dict(traffic.pp), "total": traffic.total()},
        "step_time": capacity.to_dict(time),
        "tokens_per_s_per_gpu": tokens / time.total_s / plan.world_size if time.total_s else None,
        "limits": capacity.limits(model, plan, cluster),
    }


def search(model: capacity.ModelSpec, cluster: capacity.Cluster, global_batch_tokens: int) -> dict:
    """The best plan of exercise 43's search, evaluated; ``plan`` None (and ``why``) when none fits."""
    capacity.validate(model, capacity.Plan())
    if global_batch_tokens < 1:
        raise capacity.PlanError(f"--global-batch-tokens must be at least 1, not {global_batch_tokens}")
    searched = sum(1 for _ in capacity.candidate_plans(model, cluster, global_batch_tokens))
    best = capacity.best_plan(model, cluster, global_batch_tokens)
    found = {"searched": searched, "requested_global_batch_tokens": global_batch_tokens}
    if best is not None:
        return {**found, **evaluate(model, best, cluster)}
    if searched == 0:
        why = (f"no plan of the search splits {global_batch_tokens:,} tokens ({global_batch_tokens // model.seq_len:,} "
               f"sequences) and {model.layers} layers over {cluster.gpus:,} GPUs")
    else:
        why = f"none of the {searched:,} plans searched fits in {cluster.memory_bytes / GB:g} GB per GPU"
    return {**found, "plan": None, "why": why}


def answer(model: capacity.ModelSpec, cluster: capacity.Cluster, result: dict, scenario: str | None) -> dict:
    """The whole answer: what was asked (model, cluster, scenario) and what the cost model said."""
    return {"scenario": scenario, "model": asdict(model), "parameters": capacity.total_params(model),
            "cluster": asdict(cluster), **result}


# --- text -----------------------------------------------------------------------------------------


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}" + ("" if n == 1 else "s")


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us" if s else "0 s"


def _bytes_row(name: str, value: float, note: str = "") -> str:
    return f"  {name:<28}{value / GB:>12,.3f} GB{round(value):>22,} B{note}"


def render_text(data: dict) -> str:
    m, c = data["model"], data["cluster"]
    lines = []
    if data["scenario"]:
        lines.append(f"Scenario: {data['scenario']}")
    lines.append(f"Model:   {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, vocab {m['vocab']:,}, "
                 f"sequences of {m['seq_len']:,} tokens ({data['parameters'] / 1e9:.2f} B parameters)")
    lines.append(f"Cluster: {_count(c['gpus'], 'GPU')} ({c['gpus_per_node']} per node) of "
                 f"{c['memory_bytes'] / GB:g} GB, {c['peak_flops'] / 1e12:g} TFLOP/s peak at MFU {c['mfu']:g}")
    lines.append(f"         {c['intra_node_bandwidth'] / GB:g} GB/s inside a node, "
                 f"{c['inter_node_bandwidth'] / GB:g} GB/s across nodes; latency "
                 f"{c['intra_node_latency'] * 1e6:g} us and {c['inter_node_latency'] * 1e6:g} us")
    if "searched" in data:
        found = "; the fastest that fits:" if data["plan"] else ""
        lines.append(f"Search:  {_count(data['searched'], 'plan')} for a global batch of "
                     f"{data['requested_global_batch_tokens']:,} tokens{found}")
    p = data["plan"]
    if p is None:
        lines += ["", f"No plan: {data['why']}."]
        return "\n".join(lines)
    lines.append(f"Plan:    dp {p['dp']} x tp {p['tp']} x pp {p['pp']} = {_count(p['dp'] * p['tp'] * p['pp'], 'GPU')}, "
                 f"ZeRO {p['zero']}, {p['precision']}, recompute {p['recompute']}")
    lines.append(f"         micro-batch {p['micro_batch']} x {p['micro_batches']} micro-batches ({p['schedule']}): "
                 f"{data['global_batch_tokens']:,} tokens per step")
    lines += ["", *memory_lines(data["memory"]), "", *traffic_lines(data["traffic"]), "",
              *time_lines(data["step_time"], data["tokens_per_s_per_gpu"]), "", "What limits it:"]
    lines += [f"  - {said}" for said in data["limits"]]
    return "\n".join(lines)


def memory_lines(memory: dict) -> list[str]:
    lines = ["Memory per rank (rank 0: first stage, tensor rank 0, data rank 0):"]
    for name in ("params", "grads", "optimizer", "activations"):
        lines.append(_bytes_row(name, memory[name]))
    share = memory["total"] / memory["capacity"]
    verdict = "fits" if memory["fits"] else "does NOT fit"
    lines.append(_bytes_row("total", memory["total"],
                            f"   {verdict} in {memory['capacity'] / GB:g} GB ({share:.0%})"))
    return lines


def traffic_lines(traffic: dict) -> list[str]:
    lines = ["Traffic per step (bytes rank 0 sends):"]
    for dimension in capacity.DIMENSIONS:
        for collective, sent in traffic[dimension].items():
            lines.append(_bytes_row(f"{dimension} {collective}", sent))
    if len(lines) == 1:
        lines.append("  none: dp, tp and pp are all 1")
    lines.append(_bytes_row("total", traffic["total"]))
    return lines


TIME_TERMS = {  # step_time's terms, in its order, as the grader's report names them, and what each is
    "compute_s": "compute", "dp_s": "dp communication", "tp_s": "tp communication", "pp_s": "pp communication",
    "bubble_s": "pipeline bubble", "exposed_dp_s": "dp communication compute does not hide",
}


def time_lines(time: dict, tokens_per_s: float | None) -> list[str]:
    """step_time's terms by their names (those of the grader's report), each with its share of the step."""
    total = time["total_s"]
    lines = ["Step time (rank 0):", f"  {'flops':<28}{time['flops'] / 1e12:>12,.1f} TFLOP"]
    for term, what in TIME_TERMS.items():
        share = "overlaps compute" if term == "dp_s" else f"{time[term] / total:>4.0%}" if total else ""
        lines.append(f"  {term:<28}{_seconds(time[term]):>12}   {share:<16}  {what}")
    lines.append(f"  {'total_s':<28}{_seconds(total):>12}   {'':<16}  compute + tp + pp + bubble + exposed dp")
    if tokens_per_s is not None:
        lines.append(f"  {'tokens/s per GPU':<28}{tokens_per_s:>12,.0f}")
    return lines


# --- the command ------------------------------------------------------------------------------------------


def _fail(message: str, code: int = EXIT_UNUSABLE):
    click.echo(f"ddp-grade plan: error: {message}", err=True)
    raise SystemExit(code)


def _given(values: dict, names) -> list[str]:
    return ["--" + name.replace("_", "-") for name in names if values.get(name) is not None]


H = capacity.H100


@click.command("plan")
@click.option("--layers", type=int, help="Transformer layers.")
@click.option("--hidden", type=int, help="Hidden size.")
@click.option("--heads", type=int, help="Attention heads.")
@click.option("--vocab", type=int, help="Vocabulary size.")
@click.option("--seq-len", type=int, help="Tokens per sequence.")
@click.option("--dp", type=int, help="Data-parallel size (default 1).")
@click.option("--tp", type=int, help="Tensor-parallel size (default 1).")
@click.option("--pp", type=int, help="Pipeline stages (default 1).")
@click.option("--zero", type=int, help="ZeRO stage 0-3 (default 0; 2 and 3 refused with --pp > 1).")
@click.option("--micro-batch", type=int, help="Sequences per micro-batch (default 1).")
@click.option("--micro-batches", type=int, help="Micro-batches per step (default 1).")
@click.option("--schedule", help=f"Pipeline schedule: {', '.join(capacity.SCHEDULES)} (default 1f1b).")
@click.option("--precision", help=f"{', '.join(capacity.PRECISIONS)} (default bf16-mixed).")
@click.option("--recompute", help=f"Activation recomputation: {', '.join(capacity.RECOMPUTES)} (default none).")
@click.option("--scenario", metavar="NAME",
              help="One of the kit's scenarios: " + "; ".join(f'"{k}"' for k in capacity.SCENARIOS)
              + ". Its best plan, or the plan given.")
@click.option("--best", is_flag=True,
              help="Search the fastest plan that fits (needs --gpus and --global-batch-tokens).")
@click.option("--global-batch-tokens", type=int, help="Tokens per optimizer step (the search's batch; for one plan, "
              "checked against dp x micro-batch x micro-batches x seq-len).")
@click.option("--gpus", type=int, help="GPUs of the cluster (default: dp x tp x pp).")
@click.option("--gpus-per-node", type=int, help=f"Default {H.gpus_per_node}.")
@click.option("--peak-tflops", type=float, help=f"Dense bf16 peak per GPU (default {H.peak_flops / 1e12:g}).")
@click.option("--mfu", type=float, help=f"Fraction of peak the compute achieves (default {H.mfu:g}).")
@click.option("--memory-gb", type=float, help=f"Memory per GPU, GB (default {H.memory_bytes / GB:g}).")
@click.option("--intra-gbps", type=float,
              help=f"GB/s to a GPU of the same node (default {H.intra_node_bandwidth / GB:g}).")
@click.option("--inter-gbps", type=float,
              help=f"GB/s to a GPU of another node (default {H.inter_node_bandwidth / GB:g}).")
@click.option("--intra-latency-us", type=float,
              help=f"Per message inside a node (default {H.intra_node_latency * 1e6:g}).")
@click.option("--inter-latency-us", type=float,
              help=f"Per message across nodes (default {H.inter_node_latency * 1e6:g}).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as one JSON object (bytes, seconds, FLOPs).")
def plan_command(scenario, best, global_batch_tokens, gpus, as_json, **given):
    """Ask the kit's cost model about a parallel training plan (opens once 41 and 42 pass).

    Shows rank 0's memory (params, grads, optimizer, activations; whether it fits), the bytes it
    sends per step for each dimension and collective, the step time (compute, communication,
    bubble; tokens/s per GPU) and what limits the plan. The cluster is an H100 one unless told.

    \b
    Examples:
      ddp-grade plan --layers 32 --hidden 4096 --heads 32 --vocab 128256 --seq-len 8192 \\
          --dp 8 --tp 8 --zero 1 --micro-batches 8 --recompute selective
      ddp-grade plan --scenario "70B on 1,024 GPUs"
      ddp-grade plan --layers 32 --hidden 4096 --heads 32 --vocab 128256 --seq-len 8192 \\
          --best --gpus 64 --global-batch-tokens 4194304

    Exit 0 when the cost model answered (a plan that does not fit is an answer too), 1 while
    41 and 42 have not both passed, 2 for a plan, scenario or option it cannot use.
    """
    progress = Progress()
    if progress.warning():
        click.echo(progress.warning(), err=True)
    refused = refusal(progress)
    if refused:
        click.echo(refused, err=True)
        raise SystemExit(EXIT_FAILED)
    try:
        data = _answer(scenario, best, global_batch_tokens, gpus, given)
    except capacity.PlanError as exc:
        _fail(str(exc))
    click.echo(json.dumps(data, indent=2) if as_json else render_text(data))
    raise SystemExit(EXIT_OK)


def _answer(scenario, best, global_batch_tokens, gpus, given: dict) -> dict:
    """What the command line asks, answered as plain data; PlanError for input that cannot be used."""
    plan_given = _given(given, PLAN_OPTIONS)
    if best and plan_given:
        raise capacity.PlanError(f"--best searches the plan: leave out {', '.join(plan_given)}")
    if scenario is not None:
        if _given(given, MODEL_OPTIONS):
            raise capacity.PlanError(f"--scenario sets the model: leave out {', '.join(_given(given, MODEL_OPTIONS))}")
        name = find_scenario(scenario)
        model, base, tokens = capacity.SCENARIOS[name]
        tokens = global_batch_tokens if global_batch_tokens is not None else tokens
        cluster = make_cluster(base, given, gpus if gpus is not None else base.gpus)
        if best or not plan_given:
            return answer(model, cluster, search(model, cluster, tokens), name)
        return answer(model, cluster, _one_plan(model, cluster, given, global_batch_tokens), name)
    missing = [o for o in MODEL_OPTIONS if given.get(o) is None]
    if missing:
        raise capacity.PlanError(f"the model needs {', '.join('--' + o.replace('_', '-') for o in missing)} "
                                 f"(or --scenario NAME)")
    model = capacity.ModelSpec(**{o: given[o] for o in MODEL_OPTIONS})
    if best:
        if gpus is None or global_batch_tokens is None:
            raise capacity.PlanError("--best needs --gpus and --global-batch-tokens")
        cluster = make_cluster(capacity.H100, given, gpus)
        return answer(model, cluster, search(model, cluster, global_batch_tokens), None)
    plan = _plan_of(given)
    cluster = make_cluster(capacity.H100, given, gpus if gpus is not None else max(plan.world_size, 1))
    return answer(model, cluster, _one_plan(model, cluster, given, global_batch_tokens), None)


def _plan_of(given: dict) -> capacity.Plan:
    return capacity.Plan(**{o: given[o] for o in PLAN_OPTIONS if given.get(o) is not None})


def _one_plan(model, cluster, given: dict, global_batch_tokens: int | None) -> dict:
    plan = _plan_of(given)
    capacity.validate(model, plan, cluster.gpus)
    if global_batch_tokens is not None and plan_tokens(model, plan) != global_batch_tokens:
        raise capacity.PlanError(
            f"dp x micro-batch x micro-batches x seq-len = {plan.dp} x {plan.micro_batch} x {plan.micro_batches} x "
            f"{model.seq_len} = {plan_tokens(model, plan):,} tokens, not the global batch {global_batch_tokens:,}")
    return evaluate(model, plan, cluster)
