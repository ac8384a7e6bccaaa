"""Exercise 06: gradient accumulation under DistributedDataParallel.

Rank side: wrap a small model (one DDP bucket) in torch's DDP with a
communication hook of the grader's own, which records every gradient
all-reduce DDP makes: how many forwards had run by then and whether no_sync()
was active. Then call the learner's accumulate_and_step a few times with
different numbers of micro-batches, recording parameters before and after,
the returned loss and the gradients left behind.
Grader side: recompute the single-process step on all ranks' micro-batches
together and the expected loss, and decide.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.compare import tensor_difference
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.drivers.ex06_grad_accum import LR, MICRO_COUNTS, build_model, micro_batch, rank_main


RTOL, ATOL = 1e-5, 1e-6


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        outcome = g.run(rank_main, world_size)
        timelines.keep(g, outcome, f"world size {world_size}")
        check_world(g, [o["calls"] for o in outcome.results()], world_size)


def check_world(g, per_rank: list[list[dict]], world_size: int) -> None:
    def record(check_id, ok, message="", rank=None):
        return g.record(check_id, ok, message, rank=rank, world_size=world_size)

    for call, count in enumerate(MICRO_COUNTS):
        where = f"call {call + 1} ({count} micro-batch{'es' if count > 1 else ''})"
        records = [calls[call] for calls in per_rank]
        for rank, rec in enumerate(records):
            at = f"{where}, rank {rank}"
            record("one-sync-per-call", *_sync_count_verdict(rec, at), rank)
            record("sync-on-last", *_sync_place_verdict(rec, at), rank)
            record("loss-returned", *_loss_verdict(rec, rank, call), rank)
            leftover = [n for n, t in rec["grads_after"].items() if t is not None and bool(t.any())]
            record("grads-cleared", not leftover,
                   f"{at}: after accumulate_and_step returned, {leftover[0] if leftover else ''}.grad is not "
                   "zero: the next call would add to it", rank)
        want, unscaled = expected_step(records[0]["before"], call, world_size)
        for rank, rec in enumerate(records):
            record("matches-single-process", *_step_verdict(rec, want, unscaled, f"{where}, rank {rank}"), rank)


def _sync_count_verdict(rec: dict, at: str) -> tuple[bool, str]:
    syncs = len(rec["syncs"])
    if syncs == 1:
        return True, ""
    own = ""
    if rec["other_ops"]:
        own = f" (and {len(rec['other_ops'])} collective call(s) of your own: {', '.join(sorted(set(rec['other_ops'])))})"
    if syncs == 0:
        return False, (f"{at}: DDP never all-reduced the gradients{own}; the last micro-batch's forward and "
                       "backward must run outside no_sync()")
    return False, (f"{at}: DDP all-reduced the gradients {syncs} times{own}; only the last micro-batch's backward "
                   "should, the others run forward and backward inside no_sync()")


def _sync_place_verdict(rec: dict, at: str) -> tuple[bool, str]:
    count = rec["count"]
    for sync in rec["syncs"]:
        if sync["inside_no_sync"]:
            return False, (f"{at}: DDP all-reduced the gradients during a backward run inside no_sync(): its "
                           "forward ran outside the context, and DDP prepares the all-reduce in forward")
        if sync["after_forwards"] != count:
            return False, (f"{at}: the gradient all-reduce ran after {sync['after_forwards']} forward pass(es) of "
                           f"the model, expected after the last of {count} (one forward and backward per "
                           "micro-batch, the all-reduce in the last one)")
    if rec["syncs"] and rec["forwards"] != count:
        return False, f"{at}: the model ran {rec['forwards']} forward passes for {count} micro-batches"
    return True, ""


def _loss_verdict(rec: dict, rank: int, call: int) -> tuple[bool, str]:
    at = f"call {call + 1}, rank {rank}"
    returned = rec["returned"]
    if returned["type"] != "float":
        return False, f"{at}: accumulate_and_step returned a {returned['type']}, expected a float (loss.item())"
    losses = micro_losses(rec["before"], rank, call)
    want = sum(losses) / len(losses)
    got = returned["value"]
    if abs(got - want) <= 1e-5 * max(1.0, abs(want)):
        return True, ""
    why = ""
    if abs(got - losses[-1]) <= 1e-5 * max(1.0, abs(losses[-1])):
        why = " (that is the last micro-batch's loss only)"
    elif abs(got - losses[-1] / len(losses)) <= 1e-5 * max(1.0, abs(losses[-1])):
        why = " (that is the last micro-batch's scaled loss)"
    elif abs(got - sum(losses)) <= 1e-5 * max(1.0, abs(sum(losses))):
        why = " (that is the sum, not the mean)"
    return False, f"{at}: returned {got:.6g}, expected the mean of this rank's {len(losses)} micro-batch losses, {want:.6g}{why}"


def _step_verdict(rec: dict, want: dict, unscaled: dict, at: str) -> tuple[bool, str]:
    for name, w in want.items():
        got = rec["after"][name]
        if torch.allclose(got, w, rtol=RTOL, atol=ATOL):
            continue
        why = ""
        if rec["count"] > 1 and all(torch.allclose(rec["after"][n], unscaled[n], rtol=RTOL, atol=ATOL)
                                    for n in unscaled):
            why = f" (it is the step of the summed losses, {rec['count']}x too large: divide each loss by the number of micro-batches)"
        elif torch.equal(got, rec["before"][name]):
            why = " (the parameter did not change: was optimizer.step() called?)"
        diff = tensor_difference(got, w).max_abs
        return False, (f"{at}: after the step, {name} differs from one SGD step on all ranks' micro-batches "
                       f"together by up to {diff:.3g}{why}")
    return True, ""


def expected_step(params: dict, call: int, world_size: int) -> tuple[dict, dict]:
    """One SGD step from ``params`` on every rank's micro-batches of ``call`` at once (and the unscaled one)."""
    model = build_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    count = MICRO_COUNTS[call]
    pairs = [micro_batch(r, call, i) for r in range(world_size) for i in range(count)]
    x = torch.cat([p[0] for p in pairs])
    y = torch.cat([p[1] for p in pairs])
    F.cross_entropy(model(x), y).backward()
    want, unscaled = {}, {}
    for name, p in model.named_parameters():
        want[name] = params[name] - LR * p.grad
        unscaled[name] = params[name] - LR * count * p.grad
    return want, unscaled


def micro_losses(params: dict, rank: int, call: int) -> list[float]:
    model = build_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
        return [float(F.cross_entropy(model(x), y)) for x, y in
                (micro_batch(rank, call, i) for i in range(MICRO_COUNTS[call]))]
