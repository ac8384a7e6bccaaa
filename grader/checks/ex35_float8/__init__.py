"""Exercise 35: float8 training (Float8Linear: dynamic tensorwise scaling, E4M3 forward, E5M2 gradients, the
products in torch._scaled_mm; float8_all_gather: FSDP2's all-gather of a float8 weight, one byte per element).

Rank side (:mod:`.rank`): one process builds the learner's Float8Linear from seeded nn.Linear layers and calls
it four times (a first call; a second after the weight changed in place, the input, the weight and the output's
gradient each holding one negative outlier; a layer initialised to zero; a layer without bias), running backward
of sum(output * G) each time. It records every matrix product dispatched in forward and in backward (below
autograd): for torch._scaled_mm both operands with their strides, the scales and the output dtype. It records
the output, the gradients, and the parameters when built and before and after each call; then twenty AdamW steps
of a three-layer MLP with each nn.Linear swapped for the learner's. On 2-4 ranks (gloo), each rank calls
float8_all_gather on its shard of a weight (one rank's shard holding an outlier; in the largest world, two groups
each gathering a weight of their own) and records what it returned and every collective it dispatched, with the
bytes it sent.

Grader side (:mod:`.reference`, :mod:`.verdicts`): the recipe as torchao computes it, in this process. Each
operand is compared with its tensor's cast byte for byte. The output and gradients are compared with the
products of those casts in float64, within float32's rounding of the sums. The losses are compared with the same
steps in float32, within 1/8, and the gathered weight bit for bit.
"""

from __future__ import annotations

from grader.rank.drivers import ex35_float8
from grader.checks.ex35_float8 import verdicts
import torch

from grader.checks.interface import Grader
from grader.checks.shared import timelines

LAYER_CHECKS = ("float8-formats", "scaled-from-amax", "gpu-ready", "output-matches", "grads-match")


def grade(g: Grader) -> None:
    largest = max(g.world_sizes)
    runs = [g.Run(ex35_float8.linear_main, 1)]
    runs += [g.Run(ex35_float8.rank_main, world_size, {"groups": world_size == largest and largest >= 2})
             for world_size in g.world_sizes]
    started = timelines.clock()
    outcomes = g.run_at_once(runs)  # light runs: a re-grade waits for the slowest, not for their sum

    record = next(outcomes).results()[0]
    verdicts.check_products(g, record)
    raised = verdicts.raised_in(record)
    if raised is None:
        verdicts.check_formats(g, record)
        verdicts.check_scales(g, record)
        verdicts.check_gpu_ready(g, record)
        verdicts.check_output(g, record, g.backend)
        verdicts.check_grads(g, record, g.backend)
    else:
        for check_id in LAYER_CHECKS:
            g.not_checked(check_id, "scaled-mm", f"a call of the layer raised: {raised}")
    verdicts.check_master(g, record)
    verdicts.check_training(g, record)

    gathers = {}
    for world_size in g.world_sizes:
        outcome = next(outcomes)
        timelines.keep(g, outcome, f"float8_all_gather, world size {world_size}", started=started)
        observations = outcome.results()
        gathers[world_size] = observations
        verdicts.check_gather(g, observations, world_size)
        verdicts.check_gather_bytes(g, observations, world_size)
        if world_size == largest and largest >= 2:
            verdicts.check_gather_group(g, observations, world_size)
    if largest < 2:
        g.skip("gather-group", "one rank: there is no second group to gather in")
    g.section("float8, as measured", describe(record, gathers))


# --- the report's section -----------------------------------------------------------------------


def describe(record, gathers: dict) -> str:
    """The scales of the outlier call's three products, and the bytes each rank sent per all-gather."""
    lines = []
    run = verdicts.call_record(record, "outlier")
    if run is not None:
        for e in verdicts.phase_events(run, "forward") + verdicts.phase_events(run, "backward"):
            if e["op"] == ex35_float8.SCALED_MM and len(verdicts.operands(e)) == 2:
                scales = [f"{verdicts.ROLE_WORDS[role].removeprefix('input ')} scale {1 / float(s.reshape(-1)[0]):.4g}"
                          for role, _, s in verdicts.operands(e)
                          if isinstance(s, torch.Tensor) and s.numel() == 1 and float(s.reshape(-1)[0]) != 0]
                lines.append(f"outlier call, {verdicts.PRODUCT_WORDS[verdicts.pair(e)]}: {', '.join(scales)}")
    for world_size, observations in gathers.items():
        sent = []
        for obs in observations:
            events = verdicts.clean_events(obs.get("plain") if isinstance(obs, dict) else None) or []
            sent.append(str(sum(e["bytes"] for e in events)))
        lines.append(f"{world_size} ranks: bytes each rank sent per all-gather {'/'.join(sent)} "
                     f"(its shard in float32: {4 * ex35_float8.GATHER_ROWS * ex35_float8.GATHER_COLS})")
    return "\n".join(lines)
