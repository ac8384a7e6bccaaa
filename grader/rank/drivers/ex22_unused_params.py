"""Exercise 22: "Expected to have finished reduction in the prior iteration" (a loss that leaves the auxiliary
head out during the warm-up): the drivers, run in each rank (the checks that decide:
grader/checks/ex22_unused_params.py).

Run the script's main() under torchrun's variables (see debug_rank.run_job); the probes record how each
DistributedDataParallel was built.
"""

from __future__ import annotations

from grader.rank.drivers.shared import debug_rank


EPOCHS = 3
N_TRAIN, N_VAL = 96, 48


def make_data() -> dict:
    return debug_rank.make_data(seed=22, n_train=N_TRAIN, n_val=N_VAL)
rank_main = debug_rank.job_driver(make_data, EPOCHS)
