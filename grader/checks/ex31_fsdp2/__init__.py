"""Exercise 31: shard_model and train_step with torch's FSDP2 (fully_shard, MixedPrecisionPolicy).

Rank side, one run per world size: every rank builds the grader's Transformer (the stub's
model, the same seed on every rank), calls the learner's shard_model on a 1-D DeviceMesh of
all the ranks, and records each parameter as it then is (DTensor or not, placements, mesh,
local shape, dtype) and its local values. Then three steps of train_step with the grader's
SGD on each rank's own batch, recording after each: every collective of the step (the probe's
events, each with the dtype it sent, and a mark where the model's forward returned), the returned loss and the local values of every parameter. Last, the full state
dict from torch.distributed.checkpoint (full_state_dict=True, cpu_offload=True: on rank 0).
An exception in train_step or in the state dict is recorded, under a short collective
timeout, so that what was seen before it can still be judged.

Grader side: the same model replayed in one process in the same precision (parameters cast
to bfloat16 for each rank's batch, gradients averaged in float32, clipped to the global norm,
SGD), compared with every rank's shards after each step; the rest from the records
(verdicts.py holds the verdicts).
"""

from __future__ import annotations

from grader.checks.ex31_fsdp2 import verdicts
from grader.rank.drivers.ex31_fsdp2 import build_model, rank_main
from grader.checks.ex31_fsdp2.reference import reference_run
from grader.checks.interface import Grader
from grader.checks.shared import timelines


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        outcome = g.run(rank_main, world_size)
        timelines.keep(g, outcome, f"world size {world_size}")
        observations = outcome.results()
        returned = next((o["returned"] for o in observations if o.get("returned")), None)
        if returned is not None:
            g.stop(f"shard_model returned {returned}, not the module: fully_shard shards the model in place; "
                   "return it", world_size=world_size)
        model = build_model()
        verdicts.check_placements(g, observations, world_size, model)
        if not verdicts.check_no_error(g, observations, world_size):
            continue
        if world_size > 1:  # one rank gathers nothing: its shard is the whole parameter
            verdicts.check_units(g, observations, world_size,
                                 verdicts.unit_sizes(observations[0]["params"], model, world_size))
        verdicts.check_dtypes(g, observations, world_size)
        reference = reference_run(world_size)
        verdicts.check_clipping(g, observations, reference, world_size)
        verdicts.check_training(g, observations, reference, world_size)
        verdicts.check_loss(g, observations, reference, world_size)
        verdicts.check_state_dict(g, observations, reference, world_size)
    if max(g.world_sizes) == 1:
        for check_id in ("block-units", "fp32-reduce", "global-clip"):
            g.skip(check_id, "needs a world size of 2 or more: one rank gathers and reduces nothing, its shards "
                   "are the whole model")
