"""Exercise 27: after resuming from a checkpoint the ranks disagree (only rank 0 read it).

Rank side: every rank writes the same checkpoint (the grader's own earlier run: weights, SGD
momentum buffers, epoch 1) and runs the script's main() with --resume under torchrun's
variables. Grader side: every rank's first step must start from the checkpoint's weights; each
rank's epochs must draw the data orders of the epochs after the checkpoint's; the models must be
identical and equal to a replay that starts from the checkpoint, momentum buffers included.
"""

from __future__ import annotations

import torch

from grader.checks.shared import debug_job
from grader.checks.interface import Grader
from grader.compare import first_difference
from grader.rank.drivers.shared.stub_models import TwoLayerNet
from grader.rank.drivers.ex27_resume import CHECKPOINT_EPOCH, EPOCHS, LR, MOMENTUM, N_TRAIN, make_data, rank_main


SAMPLER_SEED = 0  # DistributedSampler's default
OTHER_CHECKS = ("resumed", "epochs-continue", "params-identical", "matches-replay")


def grade(g: Grader) -> None:
    data = make_data()
    for job in debug_job.finished_jobs(g, rank_main, data, OTHER_CHECKS):
        world_size = job.world_size
        checkpoint = job.records[0]["checkpoint"]
        resumed, why = resumed_verdict(job, checkpoint["model"])
        g.record("resumed", resumed, why, world_size=world_size)
        steps = [s for s, _ in debug_job.per_rank_steps(job)]
        g.record("epochs-continue", *epochs_verdict(steps, world_size), world_size=world_size)
        g.record("params-identical", *identical_verdict(job, resumed), world_size=world_size)
        debug_job.check_replay(g, job, TwoLayerNet(), data["train_x"], data["train_y"], lr=LR, loss_fn=debug_job.cross_entropy,
                               momentum=MOMENTUM, buffers=[b.clone() if b is not None else None
                                                           for b in checkpoint["buffers"]],
                               start=checkpoint["model"], explain=explain_momentum(data, checkpoint))


def resumed_verdict(job: debug_job.Job, weights: dict) -> tuple[bool, str]:
    """Every rank's first training step starts from the checkpoint's weights."""
    for rank in range(job.world_size):
        first, _ = debug_job.trained_model(job, rank)
        if first is None:
            return False, f"rank {rank} trained no model in DDP"
        found = first_difference(first, weights)
        if found is not None:
            return False, (f"rank {rank}'s first training step did not start from the checkpoint's weights: {found}")
    return True, ""


def identical_verdict(job: debug_job.Job, resumed: bool) -> tuple[bool, str]:
    """The ranks' models are bit-identical at the end; when they started alike, say where the split comes from."""
    _, reference = debug_job.trained_model(job, 0)
    for rank in range(1, job.world_size):
        _, final = debug_job.trained_model(job, rank)
        found = None if reference is None or final is None else first_difference(final, reference)
        if found is None:
            continue
        why = f"after training, rank {rank}'s model differs from rank 0's: {found}"
        if resumed:
            why += ("; every rank started from the checkpoint's weights and DDP gave them the same averaged "
                    "gradients, so the updates differed: the optimizer's state is not the same on every rank")
        return False, why
    return True, ""


def sampler_order(epoch: int, rank: int, world_size: int, n: int = N_TRAIN) -> list[int]:
    """The order DistributedSampler(shuffle=True, seed=0) gives ``rank`` in ``epoch`` (n divides evenly)."""
    g = torch.Generator()
    g.manual_seed(SAMPLER_SEED + epoch)
    return torch.randperm(n, generator=g).tolist()[rank:n:world_size]


def epochs_verdict(steps: list[list[debug_job.Step]], world_size: int) -> tuple[bool, str]:
    """Each rank's k-th epoch after the resume draws the order of epoch CHECKPOINT_EPOCH + 1 + k."""
    for rank, rank_steps in enumerate(steps):
        epochs = debug_job.epochs_of(rank_steps, EPOCHS)
        for k, epoch in enumerate(epochs):
            want = CHECKPOINT_EPOCH + 1 + k
            got = debug_job.samples(epoch)
            if got == sampler_order(want, rank, world_size):
                continue
            drawn = next((e for e in range(0, 20) if got == sampler_order(e, rank, world_size)), None)
            what = f"the data order of epoch {drawn}" if drawn is not None else "an order the sampler does not give"
            ordinal = ("first", "second", "third")[k] if k < 3 else f"{k + 1}th"
            return False, (f"rank {rank}'s {ordinal} epoch after the resume drew {what}, not epoch {want}'s: "
                           f"the checkpoint was saved after epoch {CHECKPOINT_EPOCH}")
    return True, ""


def explain_momentum(data: dict, checkpoint: dict):
    """A failing replay: does rank 0's model match a resume without the checkpoint's momentum?"""
    def explain(per_rank, start, final) -> str:
        model = TwoLayerNet()
        model.load_state_dict(start)
        debug_job.replay(model, per_rank, data["train_x"], data["train_y"], lr=LR, loss_fn=debug_job.cross_entropy,
                         momentum=MOMENTUM)
        if debug_job.same_state(final, debug_job.cpu_state(model)):
            return "it matches a resume that started the momentum from zero: load the optimizer's state too"
        return ""
    return explain
