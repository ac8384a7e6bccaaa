"""Exercise 37: push_weights (trainer-to-inference weight sync in RL post-training: FSDP2's Shard(0) rows on the
trainer ranks to a tensor-parallel layout on the inference ranks, each slice sent once, where it is kept).

Rank side (:mod:`.rank`): one job per world size. Every rank builds a DeviceMesh of the trainer ranks of each
split of the world (4 ranks: trainers [0, 1], inference [2, 3]; 3 ranks: [0] and [1, 2], then [1, 2] and [0]);
for each split, two pushes: the usual layout (column-parallel up projections and head, row-parallel down
projections) in float32, and another engine's layout in float64. The trainer ranks shard the model with
fully_shard and fill their rows with the push's weights; the inference ranks build it on the meta device. Every
rank calls the learner's push_weights under a watch: every c10d operation (a ProcessGroup's own send and recv,
DTensor's functional collectives) with its peer and bytes, each send and receive noted in the run's folder before
it goes (a receive that meets a message of another size aborts the rank in gloo, its record lost), and after
each of them, after each Work.wait() and when push_weights returns, the whole parameters found byte for byte in
what the rank can reach. It records what push_weights returned.

Grader side (:mod:`.reference`, :mod:`.verdicts`): each inference rank's slices against the push's weights cut
as the layout says, bit for bit; every message against a trainer rank's send to an inference rank; the bytes
each trainer rank sent each inference rank against the rows it holds of what that rank keeps; the whole
parameters each rank held against those it keeps.
"""

from __future__ import annotations

from grader.checks.ex37_weight_sync import verdicts
from grader.rank.drivers.ex37_weight_sync import rank_main, splits
from grader.checks.interface import Grader
from grader.checks.shared import mismatch, timelines

CHECKS = ("returns-shards", "shards-match", "layout-honoured", "rank-lists", "slice-bytes",
          "trainer-to-inference-only", "holds-no-whole")


def readable(obs) -> bool:
    """Whether a rank's record has the shape the verdicts read (a learner's code shares the rank's process)."""
    return isinstance(obs, dict) and isinstance(obs.get("pushes"), list)


def grade(g: Grader) -> None:
    sizes = [w for w in g.world_sizes if splits(w)]
    if not sizes:
        for check_id in CHECKS:
            g.skip(check_id, "needs two ranks or more: a trainer rank and an inference rank")
        return
    lines = []
    for world_size in sizes:
        outcome = g.run(rank_main, world_size, expect_ok=False)
        # A receive that met a message of another size: gloo aborted the rank, and its record is lost.
        mismatch.stop_on_mismatch(g, outcome, "trainer-to-inference-only", world_size)
        g.stop_on_failures(outcome)
        timelines.keep(g, outcome, f"world size {world_size}")
        observations = outcome.results()
        broken = next((rank for rank, obs in enumerate(observations) if not readable(obs)), None)
        if broken is not None:
            g.stop(f"rank {broken} returned a record the grader cannot read", rank=broken, world_size=world_size)
        verdicts.check_returns(g, observations, world_size)
        verdicts.check_shards(g, observations, world_size)
        clean = verdicts.check_messages(g, observations, world_size)
        lines += verdicts.check_bytes(g, observations, world_size, clean)
        verdicts.check_held(g, observations, world_size)
    if not any(split["order"] == "reversed" for w in sizes for split in splits(w)):
        g.skip("rank-lists", "needs an odd world size: only there do the trainer ranks come last")
    g.section("the weight sync, as measured", "\n".join(lines))
