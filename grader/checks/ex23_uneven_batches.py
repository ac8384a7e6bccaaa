"""Exercise 23: the job hangs at the end of an epoch on some world sizes only (shards by hand that
give the ranks different numbers of batches).

Rank side: run the script's main() under torchrun's variables with 73 training samples (2 ranks:
37 and 36 samples, 5 batches of 8 each; 3 ranks: 25, 24 and 24, so 4, 3 and 3 batches), and once
more on the fewest ranks graded with another number of samples, 32 x world_size - 1 (2 ranks: 63,
so 32 and 31 samples: 4 batches each, but 4 and 3 with drop_last=True). A fix that evens the
batches only for 73 samples (dropping the last, short batch of shards that still differ in size)
hangs there. Grader side: the job must end on every run; each epoch must give every sample to one
rank (up to the repeats DistributedSampler pads with, and a remainder smaller than one global batch
left out); the models must be identical and equal to the replay, steps matched within each epoch
(a rank past its last batch contributes nothing, as under Join).
"""

from __future__ import annotations

from grader.checks.shared import debug_job
from grader.checks.interface import Grader
from grader.rank.drivers.shared.stub_models import TwoLayerNet
from grader.rank.drivers.ex23_uneven_batches import EPOCHS, N_TRAIN, make_data, rank_main


LR = 0.1
BATCH_SIZE = 8
OTHER_CHECKS = ("data-split", "params-identical", "matches-replay")


def other_size(world_size: int) -> int:
    """A second number of samples for ``world_size`` ranks: shares of 4 x BATCH_SIZE and one sample
    fewer (4 batches on every rank, but 4 and 3 once the last, short batch is dropped)."""
    return 4 * BATCH_SIZE * world_size - 1


def grade(g: Grader) -> None:
    runs = [(world_size, N_TRAIN) for world_size in g.world_sizes]
    smallest = min((w for w in g.world_sizes if w > 1), default=None)
    if smallest is not None:
        runs.append((smallest, other_size(smallest)))
    for world_size, n_train in runs:
        data = make_data(n_train)
        outcome = g.run(rank_main, world_size, kwargs={"n_train": n_train}, expect_ok=False)
        job = debug_job.read_job(g, outcome, data["train_x"])
        if n_train != N_TRAIN and not job.ok:
            g.record("finishes", False, other_size_message(job, n_train), world_size=world_size,
                     rank=next(e.rank for e in job.ends if not e.finished))
        if not debug_job.check_finishes(g, job):
            if n_train == N_TRAIN:
                debug_job.not_checked(g, job, OTHER_CHECKS)
                return
            for check_id in OTHER_CHECKS:
                g.not_checked(check_id, "finishes", f"the job did not finish with {n_train} samples on "
                              f"{world_size} processes (see finishes)", world_size=world_size)
            return
        steps = [s for s, _ in debug_job.per_rank_steps(job)]
        g.record("data-split", *debug_job.data_split_verdict(steps, world_size, n_train, EPOCHS, BATCH_SIZE),
                 world_size=world_size)
        debug_job.check_params_identical(g, job)
        debug_job.check_replay(g, job, TwoLayerNet(), data["train_x"], data["train_y"], lr=LR, loss_fn=debug_job.cross_entropy,
                               uneven_epochs=EPOCHS)


def shares(n: int, world_size: int) -> str:
    """How n samples fall on world_size ranks, one each in turn: "32 and 31"."""
    sizes = sorted({len(range(rank, n, world_size)) for rank in range(world_size)}, reverse=True)
    return " and ".join(map(str, sizes))


def other_size_message(job, n_train: int) -> str:
    """The job that ended on 73 samples but not on the second data size: the fix fits the numbers."""
    world_size = job.world_size
    what = "hung (collectives waited for peers that never came)" if debug_job.hung(job) else "failed"
    forwards = debug_job.training_forwards(job)
    seen = (f"the job ran on {N_TRAIN} samples, but with {n_train} samples on {world_size} processes it {what}: "
            f"{debug_job.ends_message(job)}")
    if len({n for n in forwards if n is not None}) <= 1:
        return seen
    counts = ", ".join(f"rank {r}: {n}" for r, n in enumerate(forwards) if n is not None)
    return (f"{seen} (training forwards so far: {counts}). {n_train} samples dealt out one at a time are "
            f"{shares(n_train, world_size)} a rank: 4 batches of {BATCH_SIZE} on every rank, but 4 and 3 once the "
            f"last, short batch is dropped. What evened the ranks' batches on {N_TRAIN} samples does not on "
            f"{n_train}: the ranks still take different numbers of steps")
