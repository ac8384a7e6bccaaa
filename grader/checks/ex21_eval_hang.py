"""Exercise 21: the job hangs at the first validation (a collective only rank 0 reaches).

Rank side: run the script's main() under torchrun's variables with a data file of the
grader's (see debug_job.run_job). Grader side: the job must end on every rank; each epoch's
logged val_loss must be the loss on the whole validation set of the model at that point,
which the grader knows from its own replay of the training; the ranks' models must be
identical and equal to the replay.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.checks.shared import debug_job
from grader.checks.interface import Grader
from grader.rank.drivers.shared.stub_models import TwoLayerNet
from grader.rank.drivers.ex21_eval_hang import EPOCHS, make_data, rank_main


LR = 0.1
VAL_RTOL = 1e-4
OTHER_CHECKS = ("val-loss-logged", "params-identical", "matches-replay")


def grade(g: Grader) -> None:
    data = make_data()
    for job in debug_job.finished_jobs(g, rank_main, data, OTHER_CHECKS):
        check_job(g, job, data)


def check_job(g, job: debug_job.Job, data: dict) -> None:
    debug_job.check_params_identical(g, job)
    steps, _ = debug_job.steps_of(job.records[0], job.index_of)
    ends, total = [], 0
    for epoch in debug_job.epochs_of(steps, EPOCHS):
        total += len(epoch)
        ends.append(total - 1)
    at_epoch_end: list[dict] = []

    def after_step(step, model):
        if step in ends:
            at_epoch_end.append(debug_job.cpu_state(model))

    replayed = debug_job.check_replay(g, job, TwoLayerNet(), data["train_x"], data["train_y"], lr=LR, loss_fn=debug_job.cross_entropy,
                                      after_step=after_step)
    if not replayed:
        g.not_checked("val-loss-logged", "matches-replay", "the validation loss is judged against the replayed "
                      "model, which differs (see matches-replay)", world_size=job.world_size)
        return
    expected = [val_loss(state, data) for state in at_epoch_end]
    g.record("val-loss-logged", *val_loss_verdict(job.log(), expected, data, at_epoch_end, job.world_size),
             world_size=job.world_size)


def val_loss(state: dict, data: dict, rows: slice | None = None) -> float:
    model = TwoLayerNet()
    model.load_state_dict(state)
    x, y = data["val_x"], data["val_y"]
    if rows is not None:
        x, y = x[rows], y[rows]
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def val_loss_verdict(log: list[dict], expected: list[float], data: dict, states: list[dict],
                     world_size: int) -> tuple[bool, str]:
    """Each epoch's logged val_loss against the loss of the replayed model on the whole validation set."""
    logged = {}
    for line in log:
        if "val_loss" in line and isinstance(line.get("epoch"), int):
            logged.setdefault(line["epoch"], line["val_loss"])
    for epoch, want in enumerate(expected):
        got = logged.get(epoch)
        if got is None:
            seen = ", ".join(map(str, sorted(logged))) or "none"
            return False, (f"the log has no val_loss for epoch {epoch} (epochs with one: {seen}): the validation "
                           "must stay, every epoch")
        if not isinstance(got, (int, float)) or got != got:
            return False, f"epoch {epoch}: the logged val_loss is {got!r}, not a number"
        if abs(got - want) <= VAL_RTOL * max(1.0, abs(want)):
            continue
        why = ""
        own = val_loss(states[epoch], data, slice(0, None, world_size))
        if abs(got - own) <= VAL_RTOL * max(1.0, abs(own)):
            why = " (that is the loss on rank 0's own part of the validation set only)"
        return False, (f"epoch {epoch}: the logged val_loss is {got:.6g}, but the model at the end of that epoch "
                       f"has a loss of {want:.6g} on the whole validation set{why}")
    return True, ""
