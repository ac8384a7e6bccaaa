"""Exercise 25: every epoch sees the same data order (set_epoch reaches the loader's placeholder
sampler, not the DistributedSampler inside its BatchSampler).

Rank side: run the script's main() under torchrun's variables (see debug_job.run_job); the
probes record which samples fed every step and which pass over a DataLoader they came from.
Grader side: on every rank each epoch's order must differ from every earlier epoch's; each epoch
must split the data between the ranks; the models must be identical and equal to the replay.
"""

from __future__ import annotations

from grader.checks.shared import debug_job
from grader.checks.interface import Grader
from grader.rank.drivers.shared.stub_models import TwoLayerNet
from grader.rank.drivers.ex25_data_order import EPOCHS, N_TRAIN, make_data, rank_main


LR = 0.1
BATCH_SIZE = 8
OTHER_CHECKS = ("new-order-each-epoch", "data-split", "params-identical", "matches-replay")


def grade(g: Grader) -> None:
    data = make_data()
    for job in debug_job.finished_jobs(g, rank_main, data, OTHER_CHECKS):
        world_size = job.world_size
        steps = [s for s, _ in debug_job.per_rank_steps(job)]
        g.record("new-order-each-epoch", *new_order_verdict(steps), world_size=world_size)
        g.record("data-split", *debug_job.data_split_verdict(steps, world_size, N_TRAIN, EPOCHS, BATCH_SIZE),
                 world_size=world_size)
        debug_job.check_params_identical(g, job)
        debug_job.check_replay(g, job, TwoLayerNet(), data["train_x"], data["train_y"], lr=LR, loss_fn=debug_job.cross_entropy)


def new_order_verdict(steps: list[list[debug_job.Step]], epochs: int = EPOCHS) -> tuple[bool, str]:
    """On every rank, each epoch's sequence of samples differs from every earlier epoch's."""
    for rank, rank_steps in enumerate(steps):
        orders = [debug_job.samples(epoch) for epoch in debug_job.epochs_of(rank_steps, epochs)]
        if len(orders) < epochs:
            return False, f"rank {rank} trained {len(orders)} epoch(s), expected {epochs}"
        for epoch in range(1, len(orders)):
            same = next((e for e in range(epoch) if orders[e] == orders[epoch]), None)
            if same is not None:
                first = ", ".join(map(str, orders[epoch][:BATCH_SIZE]))
                return False, (f"rank {rank}: epoch {epoch} trained on the same samples in the same order as epoch "
                               f"{same} (its first batch both times: samples {first})")
    return True, ""
