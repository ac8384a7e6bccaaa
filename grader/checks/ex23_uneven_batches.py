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

from collections import Counter

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
        g.record("data-split", *data_split_verdict(steps, world_size), world_size=world_size)
        debug_job.check_params_identical(g, job)
        debug_job.check_replay(g, job, Net(), data["train_x"], data["train_y"], lr=LR, loss_fn=loss_fn,
                               uneven_epochs=EPOCHS)


def data_split_verdict(steps: list[list[debug_job.Step]], world_size: int,
                       num_samples: int = N_TRAIN, epochs: int = EPOCHS) -> tuple[bool, str]:
    """In every epoch each sample trains on one rank: at most world_size - 1 repeats (a sampler's
    padding) and at most world_size * batch_size - 1 samples left out (a dropped remainder)."""
    grouped = [debug_job.epochs_of(rank_steps, epochs) for rank_steps in steps]
    if any(len(g) != epochs for g in grouped):
        return False, "the ranks trained " + ", ".join(f"rank {r}: {len(g)}" for r, g in enumerate(grouped)) + \
            f" epochs, expected {epochs}"
    for epoch in range(epochs):
        owners: dict[int, list[int]] = {}
        counts: Counter = Counter()
        for rank, g in enumerate(grouped):
            for i in debug_job.samples(g[epoch]):
                counts[i] += 1
                owners.setdefault(i, [])
                if rank not in owners[i]:
                    owners[i].append(rank)
        if -1 in counts:
            return False, f"epoch {epoch}: some training batches hold rows that are not in the data set"
        repeats = sum(counts.values()) - len(counts)
        if repeats > world_size - 1:
            shared = next((i for i, r in owners.items() if len(r) > 1), None)
            if shared is not None:
                return False, (f"epoch {epoch}: sample {shared} was trained on by {debug_job.rank_list(owners[shared])}, "
                               f"and {repeats} samples in all were repeated: "
                               "each rank must train on its own part of the data")
            twice = next(i for i, c in counts.items() if c > 1)
            return False, f"epoch {epoch}: sample {twice} was trained on {counts[twice]} times"
        unused = sorted(set(range(num_samples)) - set(counts))
        if len(unused) > world_size * BATCH_SIZE - 1:
            return False, (f"epoch {epoch}: {len(unused)} of {num_samples} samples were not trained on "
                           f"(e.g. {', '.join(map(str, unused[:5]))}); at most a remainder smaller than one global "
                           f"batch ({world_size} x {BATCH_SIZE}) may be left out")
    return True, ""
