"""Exercise 21: the job hangs at the first validation (a collective only rank 0 reaches): the drivers, run in
each rank (the checks that decide: grader/checks/ex21_eval_hang.py).

Run the script's main() under torchrun's variables with a data file of the grader's (see debug_rank.run_job).
"""

from __future__ import annotations

from grader.rank.drivers.shared import debug_rank


EPOCHS = 3
N_TRAIN, N_VAL = 96, 48  # divisible by 2 and 3 processes times the batch size of 8


def make_data() -> dict:
    return debug_rank.make_data(seed=21, n_train=N_TRAIN, n_val=N_VAL)
rank_main = debug_rank.job_driver(make_data, EPOCHS)
