"""Exercise 26: gradient accumulation several times slower than expected (no_sync() around the
backward only: DDP prepares the all-reduce in the forward, so every micro-batch still syncs).

Rank side: run the script's main() under torchrun's variables; a communication hook of the
grader's own records every gradient all-reduce DDP makes. Grader side: each optimizer step must
accumulate ACCUM_STEPS micro-batches with one all-reduce; the models must be identical and equal
to a replay that accumulates the same micro-batches.
"""

from __future__ import annotations

from grader.checks.shared import debug_job
from grader.checks.interface import Grader
from grader.rank.drivers.shared.stub_models import TwoLayerNet
from grader.rank.drivers.ex26_accum_sync import make_data, rank_main


LR = 0.1
ACCUM_STEPS = 4
OTHER_CHECKS = ("one-sync-per-step", "accumulates", "params-identical", "matches-replay")


def grade(g: Grader) -> None:
    data = make_data()
    for job in debug_job.finished_jobs(g, rank_main, data, OTHER_CHECKS):
        world_size = job.world_size
        steps = [s for s, _ in debug_job.per_rank_steps(job)]
        g.record("one-sync-per-step", *sync_verdict(steps), world_size=world_size)
        g.record("accumulates", *accumulation_verdict(steps), world_size=world_size)
        debug_job.check_params_identical(g, job)
        debug_job.check_replay(g, job, TwoLayerNet(), data["train_x"], data["train_y"], lr=LR, loss_fn=debug_job.cross_entropy)


def sync_verdict(steps: list[list[debug_job.Step]]) -> tuple[bool, str]:
    """Every optimizer step of every rank follows exactly one backward that all-reduced."""
    for rank, rank_steps in enumerate(steps):
        for number, step in enumerate(rank_steps):
            if step.syncs == 1:
                continue
            total = sum(s.syncs for s in rank_steps)
            counts = f"{total} gradient all-reduces for {len(rank_steps)} optimizer steps in all on rank {rank}"
            if step.syncs == 0:
                return False, (f"rank {rank}, step {number}: DDP never all-reduced the gradients of this step's "
                               f"{len(step.micro)} micro-batches ({counts}), so each rank stepped on its own "
                               "gradients")
            return False, (f"rank {rank}, step {number}: DDP all-reduced the gradients {step.syncs} times for one "
                           f"optimizer step of {len(step.micro)} micro-batches ({counts})")
    return True, ""


def accumulation_verdict(steps: list[list[debug_job.Step]]) -> tuple[bool, str]:
    """Every optimizer step accumulates ACCUM_STEPS micro-batches."""
    for rank, rank_steps in enumerate(steps):
        for number, step in enumerate(rank_steps):
            if len(step.micro) != ACCUM_STEPS:
                return False, (f"rank {rank}, step {number}: the optimizer stepped after {len(step.micro)} "
                               f"micro-batch(es), expected {ACCUM_STEPS}: keep the accumulation")
    return True, ""
