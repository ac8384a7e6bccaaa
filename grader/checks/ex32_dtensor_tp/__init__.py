"""Exercise 32: parallelize (a 2-D DeviceMesh ("dp", "tp"), a tensor-parallel plan with sequence-parallel
norms applied with parallelize_module, then fully_shard over "dp").

Rank side (rank.py): one run per world size (4 = dp 2 x tp 2, then 2 = dp 1 x tp 2). Every rank builds
the grader's Transformer on its device, calls the learner's parallelize, and records the mesh, each
parameter's placements, what each norm received, the first forward's logits, and the local values of
every parameter after each of three SGD steps (each rank on its data-parallel group's batch), with the
global ranks of every collective's group from parallelize on.

Grader side: the dense model trained in one process on every group's batch at once (float32, SGD by
hand); each rank's logits and parameters compared with its part of the dense ones, as its placements
say; the rest from the records (verdicts.py holds the verdicts), among them what one forward sends: an
all-gather of each FSDP unit among the "dp" group (each block and the root), and DTensor's all-gathers of
activations among the "tp" group (at most two per block, one before the head, one for the logits).
"""

from __future__ import annotations

from grader.checks.ex32_dtensor_tp import verdicts
from grader.rank.drivers.ex32_dtensor_tp import SEQ, build_model, rank_main, tp_size_for
from grader.checks.ex32_dtensor_tp.reference import reference_run
from grader.checks.interface import Grader
from grader.checks.shared import timelines


def grade(g: Grader) -> None:
    model = build_model()
    shapes = {name: list(p.shape) for name, p in model.named_parameters()}
    names = list(shapes)
    if all(world_size // tp_size_for(world_size) < 2 for world_size in g.world_sizes):
        g.skip("block-units", "needs a data-parallel size of 2 or more: one data-parallel rank gathers nothing, its "
               "shards are the whole parameters")
    for world_size in g.world_sizes:
        tp_size = tp_size_for(world_size)
        outcome = g.run(rank_main, world_size, kwargs={"tp_size": tp_size})
        timelines.keep(g, outcome, f"world size {world_size}")
        observations = outcome.results()
        returned = next((o["returned"] for o in observations if o.get("returned")), None)
        if returned is not None:
            g.stop(f"parallelize returned a {returned}, not (model, mesh): return the module parallelize_module and "
                   "fully_shard changed in place, and the DeviceMesh", world_size=world_size)
        done = verdicts.check_parallelize(g, observations, world_size)
        if done is None:
            rank, error = next((r, o["parallelize_error"]) for r, o in enumerate(observations)
                               if o.get("parallelize_error"))
            g.stop(f"parallelize raised {error['error']}" + (f" ({error['line']})" if error.get("line") else ""),
                   world_size=world_size, rank=rank)
        if not done:
            continue
        verdicts.check_mesh(g, observations, world_size, tp_size)
        verdicts.check_tp_placements(g, observations, world_size, tp_size, names)
        verdicts.check_dp_shards(g, observations, world_size, tp_size, shapes)
        verdicts.check_sequence_parallel(g, observations, world_size, tp_size, SEQ, names)
        verdicts.check_subgroups(g, observations, world_size, tp_size)
        if world_size // tp_size > 1:  # one data-parallel rank gathers nothing: its shards are whole
            verdicts.check_units(g, observations, world_size, tp_size, len(model.layers))
        verdicts.check_forward_gathers(g, observations, world_size, tp_size, len(model.layers))
        if verdicts.check_training_error(g, observations, world_size):
            verdicts.check_matches_dense(g, observations, reference_run(world_size, tp_size), world_size, tp_size)
