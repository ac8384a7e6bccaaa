"""``ddp-grade plan``'s answer in words (:mod:`grader.commands.plan` makes the data, this module the text)."""

from __future__ import annotations

import math
import textwrap

from grader import capacity

GB = 1e9


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


DEFAULT_MODEL = capacity.to_dict(capacity.ModelSpec(1, 1, 1, 1, 1))
DEFAULT_PLAN = capacity.to_dict(capacity.Plan())


def model_line(m: dict, parameters: int) -> list[str]:
    lines = [f"Model:   {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, vocab {m['vocab']:,}, "
             f"sequences of {m['seq_len']:,} tokens ({parameters / 1e9:.2f} B parameters)"]
    extra = [f"{k.replace('_', ' ')} {v}" for k, v in m.items()
             if k not in capacity.EXERCISE_FIELDS["ModelSpec"] and v != DEFAULT_MODEL[k]]
    if extra:
        lines.append("         " + ", ".join(extra))
    return lines


def plan_lines(p: dict, tokens: int) -> list[str]:
    world = p["dp"] * p["tp"] * p["pp"] * p["cp"]
    cp = f" x cp {p['cp']}" if p["cp"] > 1 else ""
    lines = [f"Plan:    dp {p['dp']} x tp {p['tp']} x pp {p['pp']}{cp} = {_count(world, 'GPU')}, "
             f"ZeRO {p['zero']}, {p['precision']}, recompute {p['recompute']}",
             f"         micro-batch {p['micro_batch']} x {p['micro_batches']} micro-batches ({p['schedule']}): "
             f"{tokens:,} tokens per step"]
    extra = []
    for key, value in p.items():
        if key in capacity.EXERCISE_FIELDS["Plan"] or key == "cp" or value == DEFAULT_PLAN[key]:
            continue
        if key == "stage_layers":
            value = ",".join(map(str, value)) if len(value) <= 16 else f"{value[0]},{value[1]},...,{value[-1]} ({len(value)})"
        extra.append(key.replace("_", " ") if value is True else f"{key.replace('_', ' ')} {value}")
    if extra:
        lines.append("         " + ", ".join(extra))
    return lines


def render_text(data: dict) -> str:
    c = data["cluster"]
    lines = []
    if data["scenario"]:
        lines.append(f"Scenario: {data['scenario']}")
    lines += model_line(data["model"], data["parameters"])
    kind = f"{data['gpu']}s" if data.get("gpu") else "GPUs"
    lines.append(f"Cluster: {_count(c['gpus'], 'GPU')} ({c['gpus_per_node']} per node) of "
                 f"{c['memory_bytes'] / GB:g} GB, {c['peak_flops'] / 1e12:g} TFLOP/s peak ({kind})")
    lines.append(f"         {c['intra_node_bandwidth'] / GB:g} GB/s inside a node, "
                 f"{c['inter_node_bandwidth'] / GB:g} GB/s across nodes; latency "
                 f"{c['intra_node_latency'] * 1e6:g} us and {c['inter_node_latency'] * 1e6:g} us")
    if "searched" in data:
        found = "; the fastest that fits:" if data["plan"] else ""
        rules = "43's rules" if data["search"] == "43" else "the kit's planner"
        lines.append(f"Search:  {_count(data['searched'], 'plan')} ({rules}) for a global batch of "
                     f"{data['requested_global_batch_tokens']:,} tokens{found}")
        if data["search"] == "43":
            lines.append("         (43's rules leave out what frontier runs add; --search kit searches with it)")
    p = data["plan"]
    if p is None:
        lines += ["", f"No plan: {data['why']}."]
        return "\n".join(lines)
    lines += plan_lines(p, data["global_batch_tokens"])
    lines += ["", *memory_lines(data["memory"]), "", *traffic_lines(data["traffic"]), "",
              *time_lines(data["step_time"], data), *compute_lines(data), "", "What limits it:"]
    lines += [f"  - {said}" for said in data["limits"]]
    known = data.get("published_plan")
    if known:
        lines += ["", f"The published plan ({known['source']}):", *plan_lines(known["plan"], known["global_batch_tokens"]),
                  f"         {known['memory']['total'] / GB:.1f} GB per GPU, {known['step_time']['total_s']:.2f} s a step, "
                  f"MFU {known['mfu']:.1%}", "What limits it:"]
        lines += [f"  - {said}" for said in known["limits"]]
        lines += ["", f"Why they differ: {known['why']}."]
    return "\n".join(lines)


def memory_lines(memory: dict) -> list[str]:
    lines = ["Memory per rank (rank 0: first stage, every other index 0):"]
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
        lines.append("  none: every parallel size is 1")
    lines.append(_bytes_row("total", traffic["total"]))
    return lines


TIME_TERMS = {  # step_time's terms, in its order, as the grader's report names them, and what each is
    "compute_s": "compute", "dp_s": "dp communication", "tp_s": "tp communication", "pp_s": "pp communication",
    "cp_s": "cp communication", "ep_s": "ep communication",
    "bubble_s": "pipeline bubble (and waiting on busier stages)", "exposed_dp_s": "dp communication compute does not hide",
}


def time_lines(time: dict, data: dict) -> list[str]:
    """step_time's terms by their names (those of the grader's report), each with its share of the step."""
    total = time["total_s"]
    lines = ["Step time (rank 0):", f"  {'flops':<28}{time['flops'] / 1e12:>12,.1f} TFLOP"]
    for term, what in TIME_TERMS.items():
        if term in ("cp_s", "ep_s") and not time[term]:
            continue
        share = "overlaps compute" if term == "dp_s" and data["plan"]["dp_overlap"] else \
            f"{time[term] / total:>4.0%}" if total else ""
        lines.append(f"  {term:<28}{_seconds(time[term]):>12}   {share:<16}  {what}")
    wait = " + the slowest rank" if data.get("compute", {}).get("model") == "kit" else ""
    lines.append(f"  {'total_s':<28}{_seconds(total):>12}   {'':<16}  compute + tp + pp + cp + ep + bubble + exposed dp{wait}")
    if data.get("tokens_per_s_per_gpu") is not None:
        lines.append(f"  {'tokens/s per GPU':<28}{data['tokens_per_s_per_gpu']:>12,.0f}")
        lines.append(f"  {'MFU':<28}{data['mfu']:>12.1%}   model FLOPs over every GPU's peak")
        lines.append(f"  {'TFLOP/s per GPU':<28}{data['tflops_per_gpu']:>12,.0f}   counting what is recomputed")
    return lines


def compute_lines(data: dict) -> list[str]:
    """How compute_s was timed: 42's one efficiency, or the kit's model and its parts."""
    compute, total = data["compute"], data["step_time"]["total_s"]
    if compute["model"] == "42":
        return [f"  (42's step time: every FLOP at {compute['efficiency']:g} of the peak, --compute-efficiency)"]
    lines = ["The kit's step time (docs/capacity.md): compute_s holds"]
    for key, what in (("matmul_s", "the linear maps, each from its shape"), ("attention_s", "attention"),
                      ("memory_s", "work bound by memory (norms, activations, loss, optimizer, float8's casts)")):
        lines.append(f"  {key:<28}{_seconds(compute[key]):>12}   {compute[key] / total:>4.0%}              {what}")
    lines.append(f"  {'straggler_s':<28}{_seconds(compute['straggler_s']):>12}   "
                 f"{compute['straggler_s'] / total:>4.0%}              waiting for the slowest rank (in total_s)")
    if compute["hidden_tp_s"]:
        lines.append(f"  {'hidden_tp_s':<28}{_seconds(compute['hidden_tp_s']):>12}                     "
                     f"tp communication under the weight gradients' products (not in tp_s)")
    return lines


def _figure(value: float, unit: str) -> str:
    if unit == "MFU":
        return f"{value:.1%}"
    if unit == "bytes":
        return f"{value / GB:,.3f} GB"
    return f"{value:,.0f}" if value >= 1000 else f"{value:,.1f}"


def render_published(rows: list[dict], summary: dict, readings: dict) -> str:
    """The published rows in three groups: the measured runs the fitted constants were fitted to, the
    formulas' figures the kit must equal, the measured runs held out; each by source with the configuration,
    the published figure, the kit's and their ratio; under each source what the kit reads into what it leaves
    unsaid, and the notes of single rows (marked *)."""
    fitted, measured = summary["fitted"], summary["measured"]
    fit, held = summary["fit"], summary["held_out"]
    lines = ["Published runs beside the kit's cost model (`ddp-grade plan --published --json` gives, for each row,",
             "the command that reproduces it).",
             f"Fitted to the {fit['rows']} rows of the first group: K0 = {fitted['k0']:g} (a matmul tile's fixed cost, "
             f"in multiply-adds), link efficiency {fitted['link_efficiency']:g};",
             f"measured, not fitted: sustained clock {measured['sustained']:g} of a burst's, ranks' spread "
             f"{measured['jitter']:.1%}. Error (rms of log kit / published):",
             f"fitted rows {fit['rms']:.1%} ({fit['lowest']:.2f} to {fit['highest']:.2f}), held-out rows "
             f"{held['rms']:.1%} ({held['lowest']:.2f} to {held['highest']:.2f}, {held['rows']} rows)."]
    titles = {"fit": "FITTED ON: measured runs the two fitted constants were fitted to",
              "formula": "FORMULAS: a paper's formula, not a measurement: the kit's figure must equal it",
              "held-out": "HELD OUT: measured runs the constants never saw"}
    for group, title in titles.items():
        mine = [row for row in rows if row["group"] == group]
        lines += ["", title]
        for source in dict.fromkeys(row["source"] for row in mine):
            lines += _source_lines([row for row in mine if row["source"] == source], source, readings)
    return "\n".join(lines)


def _source_lines(mine: list[dict], source: str, readings: dict) -> list[str]:
    unit, gpu = mine[0]["unit"], mine[0]["gpu"]
    kinds = sorted({row["gpu"] for row in mine if row["gpu"]})
    where = ", ".join(kinds) if kinds else "formula, no GPU"
    if len(mine) > 1:
        error = math.sqrt(sum(math.log(row["ratio"]) ** 2 for row in mine) / len(mine))
        where += f"; rms {error:.1%}" if mine[0]["group"] != "formula" else ""
    lines = ["", f"{source} ({unit}, {where}):", f"  {'configuration':<84}{'published':>12}{'kit':>12}{'ratio':>8}"]
    notes = []
    for row in mine:
        fit = f"   {row['memory_bytes'] / GB:.1f} GB per GPU" + ("" if row["fits"] else " (does NOT fit)") \
            if row["checks_memory"] else ""
        own = row["note"].removesuffix(readings[source]).removesuffix("; ")
        if own:
            notes.append(f"  * {row['row']}: {own}")
        label = row["row"] + (" *" if own else "")
        lines.append(f"  {label:<84}{_figure(row['published'], unit):>12}{_figure(row['kit'], unit):>12}"
                     f"{row['ratio']:>8.3f}{fit}")
    lines += textwrap.wrap(f"read as: {readings[source]}", 110, initial_indent="  ", subsequent_indent="    ")
    return lines + notes
