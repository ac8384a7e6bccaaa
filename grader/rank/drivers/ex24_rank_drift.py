"""Exercise 24: the ranks slowly drift apart although DDP is used (a learning-rate scheduler that each rank steps
with the loss of its own shard of the validation set): the drivers, run in each rank (the checks that decide:
grader/checks/ex24_rank_drift.py).

Run the script's main() under torchrun's variables for 6 epochs, with noisy labels so that the validation loss
stalls now and then; the probes record each step's learning rate.
"""

from __future__ import annotations

import torch

from grader.rank.drivers.shared import debug_rank


EPOCHS = 6
N_TRAIN, N_VAL = 96, 48
LABEL_NOISE = 0.2


def make_data(seed: int = 124) -> dict:
    data = debug_rank.make_data(seed=seed, n_train=N_TRAIN, n_val=N_VAL)
    g = torch.Generator().manual_seed(seed + 1)
    for key in ("train_y", "val_y"):
        y = data[key]
        noisy = torch.rand(len(y), generator=g) < LABEL_NOISE
        y[noisy] = torch.randint(0, 4, (int(noisy.sum()),), generator=g)
    return data
rank_main = debug_rank.job_driver(make_data, EPOCHS)
