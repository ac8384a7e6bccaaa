"""Exercise 36: shard_hybrid (FSDP2 over a 2-D ("replicate", "shard") mesh) and recover_from_peer (a wiped
replica's state fetched from a live one, as torchft heals a replica).

Rank side (:mod:`.rank`): one job per world size (4 ranks: 2 replicas x 2 shards in float64; 2 ranks: 2 x 1 in
float32). Every rank builds the grader's model, calls the learner's shard_hybrid, and records the mesh, each
parameter's placements and what the model, the optimizer and the learner's module hold in memory (bytes, and
whole tensors found byte for byte). Two AdamW steps on each rank's own batch, recording each step's collectives
with the global ranks of their group and the local values. At the failure the state is recorded; the two next
steps run (the replay: the job without the failure), the state is put back, every replica but the source is
wiped (fresh parameters, AdamW's state zero) and the learner's recover_from_peer runs under a watch: every c10d
operation dispatched (a ProcessGroup's own send and recv too) with its peer and bytes, each send and receive
noted in the run's folder before it goes (a receive that meets a message of another size aborts the rank in
gloo, its record lost), files opened for writing and paths torch.save writes, memory searched for whole tensors
after each message. Then the state, and the same two steps again.

Grader side (:mod:`.reference`, :mod:`.verdicts`): one process training on every rank's batch (AdamW written
out, float64), compared with the steps before the failure and the replay; the recovery bit for bit against the
source's state at the failure, the resumed steps against the replay, its messages and bytes against the state's.
"""

from __future__ import annotations

import torch

from grader.checks.ex36_hybrid_recovery import verdicts
from grader.rank.drivers.ex36_hybrid_recovery import layout, rank_main
from grader.checks.ex36_hybrid_recovery.reference import reference_run, shapes, unit_elements
from grader.checks.interface import Grader
from grader.checks.shared import mismatch, timelines


def grade(g: Grader) -> None:
    sections = []
    recovered = False
    for world_size in g.world_sizes:
        plan = layout(world_size)
        outcome = g.run(rank_main, world_size, expect_ok=False)
        # A receive that met a message of another size: gloo aborted the rank, and its record is lost.
        mismatch.stop_on_mismatch(g, outcome, "peer-messages", world_size)
        g.stop_on_failures(outcome)
        timelines.keep(g, outcome, f"world size {world_size}")
        observations = outcome.results()
        broken = next((rank for rank, obs in enumerate(observations) if not verdicts.readable(obs)), None)
        if broken is not None:
            g.stop(f"rank {broken} returned a record the grader cannot read", rank=broken, world_size=world_size)
        returned = next((o["returned"] for o in observations if o.get("returned")), None)
        if returned is not None:
            g.stop(f"shard_hybrid returned {returned}, not (model, mesh): return the model fully_shard sharded in "
                   "place and the DeviceMesh", world_size=world_size)
        itemsize = torch.empty(0, dtype=getattr(torch, plan["dtype"])).element_size()
        verdicts.check_mesh(g, observations, world_size, plan, "cuda" if g.backend == "nccl" else "cpu")
        verdicts.check_placements(g, observations, world_size, plan, shapes())
        if plan["shards"] > 1:  # one shard per replica gathers nothing: its shard is the whole parameter
            verdicts.check_units(g, observations, world_size, plan, unit_elements(plan["shards"]), itemsize)
        verdicts.check_groups(g, observations, world_size, plan)
        verdicts.check_training(g, observations, world_size, plan, reference_run(world_size))
        verdicts.check_held(g, observations, world_size, plan, itemsize)
        if plan["source"] is not None:
            verdicts.recovery_failed(g, observations, world_size)
            recovered = True
            verdicts.check_recovered(g, observations, world_size, plan)
            verdicts.check_resumed(g, observations, world_size, plan)
            if verdicts.check_messages(g, observations, world_size, plan):
                lines = verdicts.check_bytes(g, observations, world_size, plan)
            else:  # bytes that did not travel point to point are not counted
                g.not_checked("recovery-bytes", "peer-messages", "the state did not travel point to point alone",
                              world_size=world_size)
                lines = ["not counted: the state did not travel point to point alone"]
            shards = f"{plan['shards']} shard" + ("s" if plan["shards"] > 1 else "")
            sections.append(f"{world_size} ranks ({plan['replicas']} replicas x {shards}, {plan['dtype']}), replica "
                            f"{plan['source']} the source:\n  " + "\n  ".join(lines))
    if all(layout(w)["shards"] < 2 for w in g.world_sizes):
        g.skip("block-units", "needs 2 or more shards per replica: a replica of one rank gathers nothing")
    if not recovered:
        for check_id in verdicts.RECOVERY_CHECKS:
            g.skip(check_id, "needs 2 or more replicas: one replica has no peer to recover from")
    if sections:
        g.section("the recovery's bytes, as measured", "\n".join(sections))
