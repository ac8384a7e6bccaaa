"""Exercise 23: the job hangs at the end of an epoch on some world sizes only (shards by hand that give the ranks
different numbers of batches): the drivers, run in each rank (the checks that decide:
grader/checks/ex23_uneven_batches.py).

Run the script's main() under torchrun's variables with 73 training samples (2 ranks: 37 and 36 samples, 5
batches of 8 each; 3 ranks: 25, 24 and 24, so 4, 3 and 3 batches), and once more on the fewest ranks graded
with another number of samples, 32 x world_size - 1 (2 ranks: 63, so 32 and 31 samples: 4 batches each, but 4
and 3 with drop_last=True). A fix that evens the batches only for 73 samples (dropping the last, short batch
of shards that still differ in size) hangs there.
"""

from __future__ import annotations

from grader.rank.drivers.shared import debug_rank
from grader.rank.child import RankContext


EPOCHS = 3
N_TRAIN, N_VAL = 73, 48  # 3 ranks: 25, 24, 24 samples; 4, 3, 3 batches of 8


def make_data(n_train: int = N_TRAIN) -> dict:
    return debug_rank.make_data(seed=23, n_train=n_train, n_val=N_VAL)


def rank_main(ctx: RankContext) -> dict:
    path = debug_rank.write_data(ctx, make_data(ctx.kwargs.get("n_train", N_TRAIN)))
    return debug_rank.run_job(ctx, ["--data", path], epochs=EPOCHS)
