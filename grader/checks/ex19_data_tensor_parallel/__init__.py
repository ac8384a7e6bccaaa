"""Exercise 19: make_groups and train_2d (data x tensor parallelism on one set of ranks, with subgroups).

Rank side (rank.py): one run per world size (4 = dp 2 x tp 2, 2 = dp 2 x tp 1) in which every rank
calls make_groups, then train_2d on the same data, and one run at the largest world size with bad input.
Recorded: every dist.new_group call, the global ranks of the groups make_groups returns and of an
all-reduce on each, and, in train_2d, the batch of every forward, each rank's parameter blocks when it
began, the group of every collective, and the state dict returned.

Grader side: the dense MLP trained in one process with SGD on the whole batch; the verdicts (verdicts.py)
on the groups, the collectives' groups by phase, the batches, the result and the refusals.
"""

from __future__ import annotations

from collections import Counter

from grader.checks.ex19_data_tensor_parallel import verdicts
from grader.rank.drivers.ex19_data_tensor_parallel import (UNEVEN_ROWS, bad_cases, bad_main, groups_of, rank_main,
                                                          tp_size_for)
from grader.checks.ex19_data_tensor_parallel.reference import reference_run
from grader.checks.interface import Grader
from grader.checks.shared import timelines

AFTER_GROUPS = ("collective-groups", "tp-grads-own", "tp-same-batch", "dp-shards", "matches-single")


def grade(g: Grader) -> None:
    largest = max(g.world_sizes)
    runs = [g.Run(rank_main, world_size, {"tp_size": tp_size_for(world_size)}) for world_size in g.world_sizes]
    runs.append(g.Run(bad_main, largest, expect_ok=False))  # gloo may abort a rank fed a bad shape
    started = timelines.clock()
    outcomes = g.run_at_once(runs)  # light runs: a re-grade waits for the slowest, not for their sum
    reference = reference_run()
    lines = []
    for world_size in g.world_sizes:
        tp_size = tp_size_for(world_size)
        outcome = next(outcomes)
        timelines.keep(g, outcome, f"world size {world_size}", started=started)
        observations = outcome.results()
        calls_ok = verdicts.check_group_calls(g, observations, world_size)
        if not calls_ok:
            g.not_checked("group-members", "same-group-calls", "make_groups did not finish on every rank",
                          world_size=world_size)
        members_ok = calls_ok and verdicts.check_members(g, observations, world_size, tp_size)
        if not members_ok:
            cause = "same-group-calls" if not calls_ok else "group-members"
            for check_id in AFTER_GROUPS:
                g.not_checked(check_id, cause, "train_2d is judged against the groups of the statement, which "
                              "make_groups did not give every rank", world_size=world_size)
            continue
        if any((o.get("train_error") or {}).get("group_calls") for o in observations):
            verdicts.check_group_calls(g, observations, world_size)  # train_2d's own groups: recorded there
            for check_id in AFTER_GROUPS:
                g.not_checked(check_id, "same-group-calls", "train_2d's groups could not be made on every rank",
                              world_size=world_size)
            continue
        verdicts.check_collective_groups(g, observations, world_size, tp_size)
        verdicts.check_tp_grads(g, observations, world_size, tp_size)
        verdicts.check_tp_batches(g, observations, world_size, tp_size)
        verdicts.check_dp_shards(g, observations, world_size, tp_size)
        if verdicts.check_training_error(g, observations, world_size):
            verdicts.check_matches_single(g, observations, reference, world_size, tp_size)
        lines += describe_run(observations, world_size, tp_size)
    verdicts.check_bad_input(g, next(outcomes), bad_cases(largest), reference_run(UNEVEN_ROWS), largest)
    if lines:
        g.section("the groups of each rank's collectives in train_2d", "\n".join(lines))


def describe_run(observations: list[dict], world_size: int, tp_size: int) -> list[str]:
    """One line per rank: its groups, and how many collectives of each kind ran in which group, by phase."""
    out = [f"world size {world_size} (dp {world_size // tp_size} x tp {tp_size}):"]
    for rank, obs in enumerate(observations):
        dp, tp = groups_of(rank, world_size, tp_size)
        phases = Counter()
        for e in obs.get("sequence", []):
            if e.get("kind") != "collective":
                continue
            if e.get("in_forward"):
                phase = "forward"
            elif verdicts.gradient_phase(e):
                phase = "gradients"
            elif not e.get("after_forwards"):
                phase = "setup"
            else:
                phase = "after the update"
            phases[(phase, e["op"], tuple(e["group"] or ()))] += 1
        said = "; ".join(f"{phase}: {op} x{n} among {list(group)}" for (phase, op, group), n in phases.items())
        out.append(f"  rank {rank} (dp group {dp}, tp group {tp}): {said or 'no collective'}")
    return out
