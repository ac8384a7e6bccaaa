"""Exercise 26: gradient accumulation several times slower than expected (no_sync() around the backward only: DDP
prepares the all-reduce in the forward, so every micro-batch still syncs): the drivers, run in each rank (the
checks that decide: grader/checks/ex26_accum_sync.py).

Run the script's main() under torchrun's variables; a communication hook of the grader's own records every
gradient all-reduce DDP makes.
"""

from __future__ import annotations

from grader.rank.drivers.shared import debug_rank


EPOCHS = 3
N_TRAIN, N_VAL = 96, 48  # 2 ranks: 12 micro-batches of 4, 3 steps an epoch; 3 ranks: 8, 2 steps


def make_data() -> dict:
    return debug_rank.make_data(seed=26, n_train=N_TRAIN, n_val=N_VAL)
rank_main = debug_rank.job_driver(make_data, EPOCHS)
