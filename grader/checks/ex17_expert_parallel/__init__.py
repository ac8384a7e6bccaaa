"""Exercise 17: ExpertParallelMoE (expert parallelism: tokens to their experts' ranks and back by all-to-all).

Rank side (rank.py): every rank builds the same seeded router and E = 12 experts
(float64) and its own tokens, builds the learner's layer, runs forward and backward of
sum(y * G) + 0.5 * aux_loss, and records y, aux_loss, the gradients of x, of the router and of the
experts it owns, every c10d operation of forward and of backward (seen below autograd by a dispatch
mode, so torch.distributed, its functional collectives and their backwards all count: the op, dtype,
bytes, and for an all-to-all the rows per destination and the bytes sent to other ranks), and what
the module holds (its storages' bytes and which experts' weights lie in them, byte for byte).
Scenarios: a random router with room for every token, the same with a tight capacity, and a router
biased towards one expert. A second run gives an expert count the world size does not divide and
tokens of the wrong shape. Grader side: the same layer computed in one process, rank by rank (each
rank's capacity counts its own tokens; reference.py), and every rank's records
compared with it.
"""

from __future__ import annotations

from grader.rank.drivers.ex17_expert_parallel import D, SCENARIOS, TOKENS, TOP_K, bad_input_main, rank_main
from grader.checks.ex17_expert_parallel.reference import expected_run
from grader.checks.ex17_expert_parallel.verdicts import (check_all_to_all_count, check_aux, check_bad_input,
                                                         check_capacity, check_grads, check_output, check_routed_bytes,
                                                         check_sharded, data_messages)
from grader.checks.interface import Grader
from grader.checks.shared import timelines


def grade(g: Grader) -> None:
    largest = max(g.world_sizes)
    runs = [g.Run(rank_main, world_size) for world_size in g.world_sizes]
    if largest >= 2:
        runs.append(g.Run(bad_input_main, largest, expect_ok=False))
    started = timelines.clock()
    outcomes = g.run_at_once(runs)
    lines = []
    for world_size in g.world_sizes:
        outcome = next(outcomes)
        timelines.keep(g, outcome, f"world size {world_size}", draw=("plain",), started=started)
        observations = outcome.results()
        expected = {scenario: expected_run(scenario, world_size) for scenario in SCENARIOS}
        check_output(g, observations, expected["plain"], world_size)
        check_aux(g, observations, expected, world_size)
        check_grads(g, observations, expected["plain"], world_size)
        check_capacity(g, observations, expected["tight"], world_size, "tight", "capacity-order")
        check_capacity(g, observations, expected["skewed"], world_size, "skewed", "skewed-router")
        check_sharded(g, observations, world_size)
        check_all_to_all_count(g, observations, world_size)
        check_routed_bytes(g, observations, expected, world_size)
        lines.append(describe(observations, expected, world_size))
    if largest >= 2:
        lines.append(check_bad_input(g, next(outcomes), largest))
    else:
        g.skip("bad-input-refused", "one rank: every expert count is divisible by 1")
    g.section("the experts' traffic, as measured", "\n".join(line for line in lines if line))


# --- the report's section -----------------------------------------------------------------------


def describe(observations: list[dict], expected: dict, world_size: int) -> str:
    """One line per world size: rows each rank sent off-rank per forward, and dropped assignments."""
    def per_rank(values) -> str:
        return "/".join(str(v) for v in values)

    row = D * 8
    sent = []
    for obs in observations:
        a2a, _, _ = data_messages(obs["plain"]["forward_events"])
        sent.append(a2a[0]["off_rank"] // row if a2a and isinstance(a2a[0].get("off_rank"), int) else "?")
    dropped = [r["dropped"] for r in expected["skewed"]["rows"]]
    return (f"{world_size} ranks (rank 0/1/...): rows sent to other ranks' experts per forward "
            f"{per_rank(sent)} (of {TOKENS * TOP_K} assignments each); skewed router: assignments dropped "
            f"{per_rank(dropped)}")
