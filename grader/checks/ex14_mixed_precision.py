"""Exercise 14: train_step_amp, a mixed-precision step under DistributedDataParallel.

Rank side: for each graded dtype, wrap a small float32 model in torch's DDP,
give it plain SGD and a GradScaler of the grader's settings, and call the
learner's train_step_amp for a few steps with the grader's batches and
max_norm values. Two steps are not finite on the last rank only: at one, a
gradient hook turns one gradient entry into inf before DDP averages it (every
rank's loss finite); at another, the rank's batch holds an inf, so its own loss
is NaN while the other ranks' are finite (a bad batch). Recorded per step: the
parameters before and after, the scale before and after, the dtype each linear
layer computed in, the value returned, the gradients left behind, and when the
step raised, where and in what state the scaler was when the call began.
Grader side: recompute each step in this process (the same autocast forward
on every rank's batch, scaled backward, average, unscale, clip, SGD) from
rank 0's parameters before it, and decide.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from grader.compare import largest_difference
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.drivers.ex14_mixed_precision import (BACKOFF_FACTOR, BAD_BATCH_STEP, DTYPES, GROWTH_FACTOR,
                                                      GROWTH_INTERVAL, INF_STEP, INIT_SCALE, LR, NONFINITE_STEPS,
                                                      SCALER_NOT_UPDATED, STEPS, batch, build_model, rank_main)


# max_norm as a multiple of the step's true gradient norm: step 0 needs no clipping of the true
# gradients (but the scaled ones, INIT_SCALE times larger, would be clipped); the others halve it.
NORM_FACTORS = (4.0, 0.5, 0.5, 0.5, 0.5, 0.5)
RTOL, ATOL = 1e-4, 1e-6  # parameters after a step against the grader's recomputation (on the CPU)


# On GPUs the ranks' 16-bit matrix products round differently from the grader's CPU recomputation.
GPU_RTOL, GPU_ATOL = 1e-3, 1e-4
RATIO_TOL = 1e-2  # the update's size relative to the gradient's, against what clipping gives
LOSS_RTOL = 1e-3


# What each of those messages means when the scaler was fresh (after update()) as the call began.
SCALER_TWICE = {
    SCALER_NOT_UPDATED[0]: "scaler.unscale_(optimizer) ran after scaler.step(optimizer) in the same step",
    SCALER_NOT_UPDATED[1]: "scaler.step(optimizer) ran a second time in the same step",
    SCALER_NOT_UPDATED[2]: "scaler.unscale_(optimizer) ran a second time in the same step",
}


def nonfinite_cause(step: int, world_size: int) -> str:
    """What the grader made non-finite at ``step``, in words."""
    bad = world_size - 1
    if step == BAD_BATCH_STEP:
        return (f"rank {bad}'s batch held an inf, so its own loss was NaN while the other ranks' losses were finite "
                "(DDP's all-reduce then made every rank's gradients non-finite)")
    return f"rank {bad}'s gradient was inf (every rank's loss finite)"


def expected_scales() -> list[float]:
    """The scale after each step of a correct run: GradScaler's growth and backoff, written out."""
    scale, good, out = INIT_SCALE, 0, []
    for step in range(STEPS):
        if step in NONFINITE_STEPS:
            scale, good = scale * BACKOFF_FACTOR, 0
        else:
            good += 1
            if good == GROWTH_INTERVAL:
                scale, good = scale * GROWTH_FACTOR, 0
        out.append(scale)
    return out


def reference_gradient(params: dict, step: int, dtype_index: int, dtype: torch.dtype, scale: float,
                       world_size: int) -> tuple[dict, list[float]]:
    """The true (unscaled) gradient DDP averages over the ranks, computed as the ranks compute it,
    and each rank's unscaled loss: autocast forward, backward on loss * scale, divided by scale."""
    model = build_model()
    model.load_state_dict(params)
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    losses = []
    for rank in range(world_size):
        model.zero_grad()
        x, y = batch(rank, step, dtype_index, world_size)
        with torch.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        (loss * scale).backward()
        losses.append(float(loss.detach()))
        for name, p in model.named_parameters():
            total[name] += p.grad * (1.0 / scale)
    return {name: t / world_size for name, t in total.items()}, losses


def norm(tensors: dict) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def sgd(params: dict, grad: dict, factor: float) -> dict:
    """params - LR * factor * grad (factor: the clipping coefficient)."""
    return {name: params[name] - LR * factor * grad[name] for name in params}


def clip_factor(grad_norm: float, max_norm: float) -> float:
    """What clip_grad_norm_ multiplies the gradients by."""
    return min(1.0, max_norm / (grad_norm + 1e-6))


def plan_max_norms(world_size: int) -> list[list[float]]:
    """max_norm for each step of each dtype, from the true gradient norms of a correct run."""
    out = []
    for index, name in enumerate(DTYPES):
        dtype = getattr(torch, name)
        params = {k: v.detach().clone() for k, v in build_model().state_dict().items()}
        scales = [INIT_SCALE] + expected_scales()
        norms = []
        for step in range(STEPS):
            grad, _ = reference_gradient(params, step, index, dtype, scales[step], world_size)
            g_norm = norm(grad)
            # The bad batch's gradient is NaN: that step keeps the previous max_norm, a finite one.
            max_norm = NORM_FACTORS[step] * g_norm if math.isfinite(g_norm) else norms[-1]
            norms.append(max_norm)
            if step not in NONFINITE_STEPS:
                params = sgd(params, grad, clip_factor(g_norm, max_norm))
        out.append(norms)
    return out


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        max_norms = plan_max_norms(world_size)
        outcome = g.run(rank_main, world_size, kwargs={"max_norms": max_norms})
        timelines.keep(g, outcome, f"world size {world_size}")
        per_rank = outcome.results()
        check_called_twice(g, [r["runs"] for r in per_rank], world_size)
        for index, name in enumerate(DTYPES):
            check_dtype_run(g, [r["runs"][index] for r in per_rank], index, max_norms[index], world_size)
    if max(g.world_sizes) < 2:
        g.skip("params-identical", "one rank has no other rank's parameters to differ from: needs 2 ranks or more")


def called_twice(rec: dict) -> str | None:
    """What the learner's call did twice, when the scaler refused it although it began fresh (after
    update()): then the second unscale_ or step came from the same call. None otherwise."""
    if not rec["error"] or rec.get("stage_before") != "READY":
        return None
    return next((what for message, what in SCALER_TWICE.items() if message in rec["error"]), None)


def check_called_twice(g, runs_per_rank: list[list[dict]], world_size: int) -> None:
    """A call that unscales or steps twice makes GradScaler raise at once: nothing can be graded after
    it. Say so, and where, and stop."""
    found = [(index, step, rank, rec) for rank, runs in enumerate(runs_per_rank) for index, run in enumerate(runs)
             for step, rec in enumerate(run["steps"]) if called_twice(rec)]
    if not found:
        return
    index, step, rank, rec = min(found, key=lambda f: f[:3])
    what, where = called_twice(rec), rec.get("where")
    at = f", at line {where['line']} (`{where['code']}`)" if where else ""
    raising = sorted({r for i, s, r, _ in found if (i, s) == (index, step)})
    on = "every rank" if len(raising) == world_size else "rank " + ", ".join(map(str, raising))
    for r, runs in enumerate(runs_per_rank):
        computed_in = runs[index]["steps"][step]["computed_in"] if len(runs[index]["steps"]) > step else []
        if computed_in:  # the forward ran before the call raised: its dtype can be judged
            wrong = [d for d in computed_in if d != f"torch.{DTYPES[index]}"]
            g.record("autocast-forward", not wrong, f"{DTYPES[index]}: step {step}, rank {r}: the model's linear "
                     f"layers computed in {', '.join(computed_in)}, expected torch.{DTYPES[index]}", rank=r,
                     world_size=world_size)
    advice = ("call scaler.step(optimizer) once per step" if "step(optimizer) ran a second" in what else
              "call scaler.unscale_(optimizer) once per step, after backward and before clip_grad_norm_ and "
              "scaler.step (scaler.step does not unscale again after it)")
    check_id = "matches-reference" if "step(optimizer) ran a second" in what else "clips-true-gradients"
    g.record(check_id, False, f"{DTYPES[index]}: step {step}, {on}: train_step_amp raised {rec['error'].rstrip('.')}"
             f"{at}: {what}. GradScaler allows one unscale_ and one step per optimizer between two update() calls, "
             f"and raises on a second; {advice}", rank=rank, world_size=world_size)
    g.stop(f"train_step_amp raised on {on} at step {step} ({DTYPES[index]}){at}: {what}, which GradScaler refuses; "
           "the steps from there on could not be graded", world_size=world_size, rank=rank)


def check_dtype_run(g, runs: list[dict], dtype_index: int, max_norms: list[float], world_size: int) -> None:
    name = DTYPES[dtype_index]
    dtype = getattr(torch, name)

    def record(check_id, ok, message="", rank=None):
        return g.record(check_id, ok, f"{name}: {message}", rank=rank, world_size=world_size)

    def record_autocast(rec, at, rank):
        wrong = [d for d in rec["computed_in"] if d != str(dtype)]
        record("autocast-forward", rec["computed_in"] and not wrong,
               f"{at}, rank {rank}: the model's linear layers computed in {', '.join(rec['computed_in']) or 'nothing'}"
               f", expected {dtype} (the forward under torch.autocast(device_type, dtype=dtype))"
               if rec["computed_in"] else f"{at}, rank {rank}: the model never ran forward", rank)

    scales = expected_scales()
    steps_done = min(len(r["steps"]) for r in runs)
    for step in range(steps_done):
        records = [r["steps"][step] for r in runs]
        at = f"step {step}"
        if any(rec["error"] for rec in records):
            for rank, rec in enumerate(records):
                if rec["computed_in"]:  # the forward ran before the call raised
                    record_autocast(rec, at, rank)
            steps_done = step
            break  # the errors are reported below
        for rank, rec in enumerate(records):
            record_autocast(rec, at, rank)
            record("grads-cleared", not rec["grads_after"],
                   f"{at}, rank {rank}: after train_step_amp returned, {rec['grads_after'][:1]}.grad is not zero: the "
                   "next step would add to it", rank)
            record("scale-updates", rec["scale_after"] == scales[step],
                   _scale_message(rec, step, scales, rank, world_size), rank)
        for rank in range(1, world_size):
            found = largest_difference(_comparable(records[rank]["after"]), _comparable(records[0]["after"]))
            record("params-identical", found is None,
                   f"{at}: after the step, rank {rank}'s parameters differ from rank 0's: {found}", rank)

        before, scale = records[0]["before"], records[0]["scale_before"]
        grad, losses = reference_gradient(before, step, dtype_index, dtype, scale, world_size)
        g_norm = norm(grad)
        for rank, rec in enumerate(records):
            record("loss-returned", *_loss_verdict(rec, losses[rank], f"{at}, rank {rank}"), rank)
        if step in NONFINITE_STEPS:
            check_scales_agree(g, records, step, name, world_size)
            if not check_skip(g, records, step, name, world_size):
                steps_done = STEPS  # the steps after a NaN update say nothing more
                break
            continue
        factor = clip_factor(g_norm, max_norms[step])
        want = sgd(before, grad, factor)
        after = records[0]["after"]
        record("clips-true-gradients", *_clip_verdict(before, after, grad, g_norm, max_norms[step], scale, at), 0)
        found = largest_difference({k: v for k, v in after.items()}, want)
        rtol, atol = (GPU_RTOL, GPU_ATOL) if g.backend == "nccl" else (RTOL, ATOL)
        close = found is None or all(
            torch.allclose(after[k].double(), want[k].double(), rtol=rtol, atol=atol) for k in want)
        record("matches-reference", close,
               f"{at}: rank 0's parameters differ from the grader's step (autocast {name} forward on every rank's "
               f"batch, scaled backward, average, unscale, clip to max_norm={max_norms[step]:.4g}, SGD lr={LR}): "
               f"{found}", 0)
    for rank, r in enumerate(runs):
        errors = [(s, rec["error"]) for s, rec in enumerate(r["steps"]) if rec["error"]]
        if not errors:
            continue
        step, error = errors[0]
        if any(m in error for m in SCALER_NOT_UPDATED):
            record("scale-updates", False, f"step {step}, rank {rank}: the scaler refused the step: {error.rstrip('.')}. The "
                   f"previous step did not end with scaler.update(), which resets the scaler for the next one"
                   f"{_why_not_updated(r['steps'], step, rank, world_size)}", rank)
        else:
            record("skips-nonfinite", False, f"step {step}, rank {rank}: when {nonfinite_cause(step, world_size)}, "
                   f"train_step_amp raised {error}; the scaler must skip that step, and training go on", rank)
    for skipped in NONFINITE_STEPS:
        if steps_done <= skipped + 1:
            continue
        for rank, r in enumerate(runs):
            rec = r["steps"][skipped + 1]
            if largest_difference(rec["after"], rec["before"]) is None:
                record("skips-nonfinite", False, f"step {skipped + 1}, rank {rank}: the step after the skipped one "
                       "left the parameters unchanged: training must go on with the smaller scale", rank)
    first_error = min(((s, rank) for rank, r in enumerate(runs) for s, rec in enumerate(r["steps"]) if rec["error"]),
                      default=None)
    why = f": at step {first_error[0]}, train_step_amp raised on rank {first_error[1]}" if first_error else ""
    unreached = next((s for s in NONFINITE_STEPS if steps_done <= s), None)
    if unreached is not None and not any(rec["error"] for r in runs for rec in r["steps"][unreached:unreached + 1]):
        record("skips-nonfinite", False, f"the steps stopped at step {steps_done}, before step {unreached}, where "
               f"{nonfinite_cause(unreached, world_size)}{why}")
    if steps_done < STEPS:
        for check_id in ("matches-reference", "scale-updates"):
            record(check_id, False, f"only {steps_done} of {STEPS} steps could be graded{why}")


def _why_not_updated(steps: list[dict], step: int, rank: int, world_size: int) -> str:
    """When the step that did not end with update() was the bad batch's, on the rank whose loss was NaN."""
    if step - 1 != BAD_BATCH_STEP or rank != world_size - 1:
        return ""
    previous = steps[step - 1]
    return (f". At step {step - 1} this rank's own loss was NaN (its batch held an inf) and its scale stayed "
            f"{previous['scale_after']:g}: train_step_amp skipped scaler.update() on this rank alone, from this rank's "
            "loss; the other ranks' losses were finite and they updated")


def check_scales_agree(g, records: list[dict], step: int, name: str, world_size: int) -> None:
    """At a non-finite step every rank's scaler sees the same (all-reduced, non-finite) gradients: every
    rank must back off. A rank whose scale stayed put skipped update(), typically from its own loss."""
    moved = [rank for rank, rec in enumerate(records) if rec["scale_after"] != rec["scale_before"]]
    stayed = [rank for rank, rec in enumerate(records) if rec["scale_after"] == rec["scale_before"]]
    if not moved or not stayed:
        return  # the same on every rank: scale-updates judges the value
    bad_rank = world_size - 1
    listed = ", ".join(map(str, stayed))
    own_loss = ""
    if step == BAD_BATCH_STEP and bad_rank in stayed:
        own_loss = f", deciding from rank {bad_rank}'s own loss (the only one that was NaN)"
    g.record("skips-nonfinite", False,
             f"{name}: step {step}: {nonfinite_cause(step, world_size)}. Rank {moved[0]}'s scale went from "
             f"{records[moved[0]]['scale_before']:g} to {records[moved[0]]['scale_after']:g}, but rank {listed}'s "
             f"stayed {records[stayed[0]]['scale_before']:g}: train_step_amp skipped scaler.update() there{own_loss}. "
             "The ranks' scales now differ, and the next step raises. Call scaler.step(optimizer) and "
             "scaler.update() on every rank, every step: the scaler skips the update by itself when the averaged "
             "gradients are not finite, the same way on every rank", rank=stayed[0], world_size=world_size)


def _scale_message(rec: dict, step: int, scales: list[float], rank: int, world_size: int) -> str:
    got, want, before = rec["scale_after"], scales[step], rec["scale_before"]
    why = ""
    if step == BAD_BATCH_STEP and rank == world_size - 1 and got == before:
        why = (" (this rank's own loss was NaN at this step, its batch holding an inf: the gradients were not finite, "
               "and scaler.update() halves the scale after the skipped step on every rank)")
    elif step in NONFINITE_STEPS and got == before:
        why = " (a gradient was inf at this step: scaler.update() halves the scale after a skipped step)"
    elif got == before:
        why = " (the scale did not change: is scaler.update() called once per step?)"
    return (f"step {step}, rank {rank}: the scale went from {before:g} to {got:g}; expected {want:g} "
            f"(GradScaler(init_scale={INIT_SCALE:g}, growth_interval={GROWTH_INTERVAL}, backoff_factor="
            f"{BACKOFF_FACTOR:g}), the gradients of steps {INF_STEP} and {BAD_BATCH_STEP} not finite){why}")


def _loss_verdict(rec: dict, want: float, at: str) -> tuple[bool, str]:
    returned = rec["returned"]
    if returned["type"] != "float":
        return False, f"{at}: train_step_amp returned a {returned['type']}, expected a float (loss.item())"
    got = returned["value"]
    if not math.isfinite(want):  # the bad batch's rank: its loss is NaN, and so is what it returns
        if not math.isfinite(got):
            return True, ""
        return False, (f"{at}: returned {got:.6g}, but this rank's loss was {want} (its batch held an inf): return the "
                       "loss as computed, unscaled")
    if abs(got - want) <= LOSS_RTOL * max(1.0, abs(want)):
        return True, ""
    why = ""
    if abs(got - want * rec["scale_before"]) <= LOSS_RTOL * abs(want * rec["scale_before"]):
        why = f" (that is the scaled loss, {rec['scale_before']:g} times too large)"
    return False, f"{at}: returned {got:.6g}, expected this rank's unscaled loss {want:.6g}{why}"


def _clip_verdict(before: dict, after: dict, grad: dict, g_norm: float, max_norm: float, scale: float,
                  at: str) -> tuple[bool, str]:
    """The update's size against the true gradient's: what clip_grad_norm_ on the unscaled gradients gives."""
    update = {k: (before[k] - after[k]) / LR for k in before}
    observed = norm(update) / g_norm
    expected = clip_factor(g_norm, max_norm)
    if not math.isfinite(observed):
        return False, f"{at}: the parameters are not finite after the step"
    if abs(observed - expected) <= RATIO_TOL * expected:
        return True, ""
    situation = (f"{at}: the true gradient norm was {g_norm:.4g} and max_norm {max_norm:.4g}, so the update should "
                 f"be {expected:.3g} x the gradient; it was {observed:.3g} x")
    guesses = [
        (1.0, "the gradients were not clipped"),
        (clip_factor(g_norm * scale, max_norm), f"the scaled gradients ({scale:g} x) were clipped: call "
                                                 "scaler.unscale_(optimizer) before clip_grad_norm_"),
        (scale * clip_factor(g_norm * scale, max_norm), "the gradients were never unscaled"),
        (scale * expected, "the gradients were never unscaled"),
        (0.0, "the parameters did not change"),
    ]
    for ratio, why in guesses:
        if abs(observed - ratio) <= RATIO_TOL * max(ratio, 1e-6) and abs(ratio - expected) > RATIO_TOL * expected:
            return False, f"{situation}: {why}"
    return False, situation


def _comparable(params: dict) -> dict:
    """NaN where NaN, so that two ranks holding the same NaNs count as identical."""
    return {k: torch.nan_to_num(v.double(), nan=1e300, posinf=1e301, neginf=-1e301) for k, v in params.items()}


def check_skip(g, records: list[dict], step: int, name: str, world_size: int) -> bool:
    """A step with one rank's gradient or loss not finite: every rank keeps its parameters, finite.
    False when the parameters are no longer finite (the steps after it cannot be graded)."""
    def record(check_id, ok, message="", rank=None):
        return g.record(check_id, ok, f"{name}: {message}", rank=rank, world_size=world_size)

    cause = nonfinite_cause(step, world_size)
    finite = True
    for rank, rec in enumerate(records):
        if rec["error"]:
            continue  # reported with the others' errors
        bad = [k for k, v in rec["after"].items() if not bool(torch.isfinite(v).all())]
        if bad:
            finite = False
            record("skips-nonfinite", False, f"step {step}, rank {rank}: {cause}, and afterwards {bad[0]} holds inf "
                   "or NaN: the update was applied instead of skipped", rank)
            continue
        found = largest_difference(rec["after"], rec["before"])
        if found is not None:
            record("skips-nonfinite", False, f"step {step}, rank {rank}: {cause}, but the parameters changed "
                   f"({found}): every rank must skip this step", rank)
            continue
        record("skips-nonfinite", True)
    return finite
