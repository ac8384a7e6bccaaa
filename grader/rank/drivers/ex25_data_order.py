"""Exercise 25: every epoch sees the same data order (set_epoch reaches the loader's placeholder sampler, not the
DistributedSampler inside its BatchSampler): the drivers, run in each rank (the checks that decide:
grader/checks/ex25_data_order.py).

Run the script's main() under torchrun's variables (see debug_rank.run_job); the probes record which samples
fed every step and which pass over a DataLoader they came from.
"""

from __future__ import annotations

from grader.rank.drivers.shared import debug_rank


EPOCHS = 3
N_TRAIN, N_VAL = 96, 48


def make_data() -> dict:
    return debug_rank.make_data(seed=25, n_train=N_TRAIN, n_val=N_VAL)
rank_main = debug_rank.job_driver(make_data, EPOCHS)
