"""Exercise 24: the ranks slowly drift apart although DDP is used (a learning-rate scheduler that
each rank steps with the loss of its own shard of the validation set).

Rank side: run the script's main() under torchrun's variables for 6 epochs, with noisy labels so
that the validation loss stalls now and then; the probes record each step's learning rate.
Grader side: replay the training in one process, with ReduceLROnPlateau's rule applied to the
loss on the whole validation set after each epoch; every rank must train each epoch at the
learning rate the replay gives, and the models must be identical and equal to the replay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.checks.shared import debug_job
from grader.compare import largest_difference
from grader.checks.interface import Grader
from grader.rank.drivers.shared.stub_models import TwoLayerNet
from grader.rank.drivers.ex24_rank_drift import EPOCHS, make_data, rank_main


LR = 0.1
FACTOR, THRESHOLD = 0.5, 0.03  # ReduceLROnPlateau(mode="min", factor=0.5, patience=0, threshold=0.03)
TOLERANCE = 1e-5
OTHER_CHECKS = ("params-identical", "lr-schedule", "matches-replay")


def grade(g: Grader) -> None:
    data = make_data()
    for job in debug_job.finished_jobs(g, rank_main, data, OTHER_CHECKS):
        debug_job.check_params_identical(g, job)
        check_schedule(g, job, data)


def step_lrs(record: dict) -> list[float | None]:
    """The learning rate of each optimizer step of this rank, in order."""
    return [e.get("lr") for e in record["events"] if e.get("what") == "step"]


def replay_schedule(start: dict, epochs: list[list[list[list[int]]]], data: dict) -> tuple[dict, list[dict]]:
    """Train in one process with the schedule on the whole validation set's loss.

    ``epochs[e][r]``: rank r's micro-batches of each step of epoch e. Returns the final state and,
    per epoch, ``lr`` (the rate it trained at), ``val_loss`` after it and ``best`` before it.
    """
    model = TwoLayerNet()
    model.load_state_dict(start)
    lr, best = LR, float("inf")
    log = []
    for per_rank in epochs:
        debug_job.replay(model, per_rank, data["train_x"], data["train_y"], lr=lr, loss_fn=debug_job.cross_entropy)
        with torch.no_grad():
            val_loss = float(F.cross_entropy(model(data["val_x"]), data["val_y"]))
        log.append({"lr": lr, "val_loss": val_loss, "best": best})
        if val_loss < best * (1 - THRESHOLD):  # ReduceLROnPlateau, mode "min", threshold_mode "rel"
            best = val_loss
        else:  # patience 0: the first epoch without enough improvement halves the rate
            lr *= FACTOR
    return debug_job.cpu_state(model), log


def check_schedule(g, job: debug_job.Job, data: dict) -> None:
    ws = job.world_size
    steps = [s for s, _ in debug_job.per_rank_steps(job)]
    grouped = [debug_job.epochs_of(rank_steps, EPOCHS) for rank_steps in steps]
    first, final = debug_job.trained_model(job, 0)
    shape = {(len(gr), tuple(len(e) for e in gr)) for gr in grouped}
    if len(shape) != 1 or first is None:
        message = "the ranks took different numbers of optimizer steps: " + debug_job.step_counts(steps)
        for check in ("lr-schedule", "matches-replay"):
            g.record(check, False, message, world_size=ws)
        return
    misfit = debug_job.load_into(TwoLayerNet(), first)
    if misfit:
        for check in ("lr-schedule", "matches-replay"):
            g.record(check, False, f"the model is not the script's: {misfit} (keep the model as it is)", world_size=ws)
        return
    epochs = [[[s.micro for s in gr[e]] for gr in grouped] for e in range(len(grouped[0]))]
    replayed, log = replay_schedule(first, epochs, data)
    lrs = [step_lrs(record) for record in job.records]
    g.record("lr-schedule", *schedule_verdict(lrs, [len(e) for e in grouped[0]], log), world_size=ws)
    found = largest_difference(final, replayed)
    g.record("matches-replay", found is None or found.max_abs <= TOLERANCE,
             f"after {len(steps[0])} steps, rank 0's model differs from one process training on the same global "
             f"batches with the schedule on the whole validation set's loss: {found}", rank=0, world_size=ws)


def _same_rate(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b))  # a rate sent through a float32 tensor is still the rate


def _distinct(rates: list[float]) -> list[float]:
    out: list[float] = []
    for rate in rates:
        if not any(_same_rate(rate, seen) for seen in out):
            out.append(rate)
    return out


def schedule_verdict(lrs: list[list], per_epoch: list[int], log: list[dict]) -> tuple[bool, str]:
    """Every rank trains each epoch at the rate the schedule gives on the whole validation set."""
    start = 0
    for epoch, count in enumerate(per_epoch):
        want = log[epoch]["lr"]
        seen = [_distinct([lr for lr in rank_lrs[start:start + count] if lr is not None]) for rank_lrs in lrs]
        start += count
        if any(len(s) > 1 for s in seen):
            rank = next(r for r, s in enumerate(seen) if len(s) > 1)
            return False, f"epoch {epoch}: rank {rank} changed the learning rate within the epoch ({seen[rank]})"
        got = [s[0] if s else None for s in seen]
        if len(_distinct([lr for lr in got if lr is not None])) > 1:
            return False, (f"epoch {epoch}: the ranks trained at different learning rates ("
                           + ", ".join(f"rank {r}: {lr:g}" for r, lr in enumerate(got) if lr is not None) + ")")
        if got[0] is not None and not _same_rate(got[0], want):
            if epoch == 0:
                return False, f"epoch 0 trained at lr {got[0]:g}, expected {want:g}"
            before = log[epoch - 1]
            improved = before["val_loss"] < before["best"] * (1 - THRESHOLD)
            why = (f"after epoch {epoch - 1} the loss on the whole validation set was {before['val_loss']:.5g} "
                   f"against a best of {before['best']:.5g}: " +
                   ("an improvement of more than 3%, so the rate stays" if improved else
                    "less than 3% better, so the rate is halved"))
            return False, f"epoch {epoch}: every rank trained at lr {got[0]:g}, expected {want:g} ({why})"
    return True, ""
