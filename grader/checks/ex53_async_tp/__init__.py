"""Exercise 53: allgather_matmul and matmul_reduce_scatter, tensor parallelism's collectives cut into steps
around a ring and hidden under the matmuls (async TP, collective matmul).

One run per world size, its inputs drawn from a seed the grader picks for this grading. Each rank calls both
functions in float64 on the whole world and, at 4 ranks and more, on the even and the odd ranks' groups, then
backward on each output with a gradient of its own, recording the output and the gradients, and in order every
point-to-point and collective call (issued, waited for, to whom, how many bytes) and every matrix product, with
the contents of what the rank held as each product began (grader.rank.drivers.ex53_async_tp).

The grader computes the all-gather then matmul and the matmul then reduce-scatter in one process, compares every
output and gradient (value), looks for the gathered input, and for more chunks of it than a ring holds, in what
each rank held (claim), and reads the sends and their order from the ranks' records (claim).
"""

from __future__ import annotations

import secrets

from grader.checks.ex53_async_tp.reference import expected, fingerprints
from grader.checks.ex53_async_tp.verdicts import (calls_of, check_rank_records, check_values, memory_message,
                                                 order_message, traffic_message)
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.drivers.ex53_async_tp import FUNCTIONS, groups_of, rank_main

VALUES = {("allgather_matmul", "output"): "allgather-matmul-output",
          ("allgather_matmul", "grads"): "allgather-matmul-grads",
          ("matmul_reduce_scatter", "output"): "matmul-reduce-scatter-output",
          ("matmul_reduce_scatter", "grads"): "matmul-reduce-scatter-grads"}


def grade(g: Grader) -> None:
    seed = secrets.randbelow(1 << 30)
    grouped = False
    for world_size in g.world_sizes:
        scenarios = ["world"] + (["pairs"] if world_size >= 4 else [])
        grouped |= "pairs" in scenarios
        outcome = g.run(rank_main, world_size, kwargs={"seed": seed, "scenarios": scenarios})
        timelines.keep(g, outcome, f"world size {world_size}", shown=world_size == max(g.world_sizes),
                       draw=("world: allgather_matmul",))
        observations = outcome.results()
        contents = [[c.numpy().tobytes() for c in o["contents"]] for o in observations]
        calls = {(s, f): calls_of(observations, s, f) for s in scenarios for f in FUNCTIONS}
        for function in FUNCTIONS:
            want = expected(seed, "world", function, world_size)
            for part in ("output", "grads"):
                check_values(g, VALUES[(function, part)], calls[("world", function)], want, function, part,
                             world_size)
            if "pairs" in scenarios:
                want = expected(seed, "pairs", function, world_size)
                where = f" on the groups {groups_of('pairs', world_size)}"
                for part in ("output", "grads"):
                    check_values(g, "within-group", calls[("pairs", function)], want, function, part, world_size,
                                 where)

        def memory(scenario, function, rank, record):
            members = next(m for m in groups_of(scenario, world_size) if rank in m)
            prints = fingerprints(seed, scenario, function, world_size, rank)
            return memory_message(record, contents[rank], prints, function, len(members))

        def traffic(scenario, function, rank, record):
            members = next(m for m in groups_of(scenario, world_size) if rank in m)
            return traffic_message(record, rank, members, function)

        check_rank_records(g, "never-whole-input", memory, calls, world_size)
        check_rank_records(g, "ring-traffic", traffic, calls, world_size)
        check_rank_records(g, "send-before-matmul", lambda s, f, r, record: order_message(record), calls,
                           world_size)
    if not grouped:
        g.skip("within-group", "needs 4 ranks or more: the groups are the even and the odd ranks")
