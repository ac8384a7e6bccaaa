"""Exercise 23: the job hangs at the end of an epoch on some world sizes only (shards by hand that
give the ranks different numbers of batches).

Rank side: run the script's main() under torchrun's variables with 73 training samples (2 ranks:
37 and 36 samples, 5 batches of 8 each; 3 ranks: 25, 24 and 24, so 4, 3 and 3 batches). Grader
side: the job must end on every world size; each epoch must give every sample to one rank (up
to the repeats DistributedSampler pads with, and a remainder smaller than one global batch left
out); the models must be identical and equal to the replay, steps matched within each epoch (a
rank past its last batch contributes nothing, as under Join).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grader.checks import debug_job
from grader.child import RankContext

EPOCHS = 3
LR = 0.1
BATCH_SIZE = 8
N_TRAIN, N_VAL = 73, 48  # 3 ranks: 25, 24, 24 samples; 4, 3, 3 batches of 8
OTHER_CHECKS = ("data-split", "params-identical", "matches-replay")


class Net(nn.Module):
    """The grader's copy of the script's model."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_data() -> dict:
    return debug_job.make_data(seed=23, n_train=N_TRAIN, n_val=N_VAL)


def loss_fn(model, x, y, step):
    return F.cross_entropy(model(x), y)


# --- in each rank ---------------------------------------------------------------------


def rank_main(ctx: RankContext) -> dict:
    path = debug_job.write_data(ctx, make_data())
    return debug_job.run_job(ctx, ["--data", path], epochs=EPOCHS)


# --- in the grader --------------------------------------------------------------------


def grade(g) -> None:
    data = make_data()
    for world_size in g.world_sizes:
        job = debug_job.read_job(g, g.run("rank_main", world_size, expect_ok=False), data["train_x"])
        if not debug_job.check_finishes(g, job):
            debug_job.not_checked(g, job, OTHER_CHECKS)
            return
        steps = [s for s, _ in debug_job.per_rank_steps(job)]
        g.record("data-split", *debug_job.data_split_verdict(steps, world_size, N_TRAIN, EPOCHS, BATCH_SIZE),
                 world_size=world_size)
        debug_job.check_params_identical(g, job)
        debug_job.check_replay(g, job, Net(), data["train_x"], data["train_y"], lr=LR, loss_fn=loss_fn,
                               uneven_epochs=EPOCHS)
