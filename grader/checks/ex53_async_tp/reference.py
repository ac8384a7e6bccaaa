"""Exercise 53, grader side: what each rank's call must return and what its backward must leave in the
gradients (the all-gather then matmul, and the matmul then reduce-scatter, in one process), and what each rank
may not hold: the inputs' chunks and the whole gathered input, from the same seed."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex53_async_tp import ROWS, groups_of, inputs


def expected(seed: int, scenario: str, function: str, world_size: int) -> list[dict]:
    """Per rank: its output and the gradients of its two arguments."""
    out: list[dict] = [{} for _ in range(world_size)]
    for members in groups_of(scenario, world_size):
        args = [inputs(seed, scenario, function, r, len(members)) for r in members]
        rows = [slice(i * ROWS, (i + 1) * ROWS) for i in range(len(members))]
        if function == "allgather_matmul":
            gathered = torch.cat([a["x"] for a in args])
            partial = [a["grad"] @ a["weight"].t() for a in args]  # each rank's share of d(gathered input)
            for i, r in enumerate(members):
                out[r] = {"output": gathered @ args[i]["weight"],
                          "grads": {"x": sum(p[rows[i]] for p in partial),
                                    "weight": gathered.t() @ args[i]["grad"]}}
        else:
            products = [a["x"] @ a["weight"] for a in args]
            gathered = torch.cat([a["grad"] for a in args])
            for i, r in enumerate(members):
                out[r] = {"output": sum(p[rows[i]] for p in products),
                          "grads": {"x": gathered @ args[i]["weight"].t(), "weight": args[i]["x"].t() @ gathered}}
    return out


def fingerprints(seed: int, scenario: str, function: str, world_size: int, rank: int) -> dict:
    """What rank ``rank`` may hold only a part of during one call, forward and backward: ``"exact"`` chunks (the
    group's inputs, passed along as they are) by the group rank they came from, ``"whole"`` their concatenation;
    for matmul_reduce_scatter's forward, ``"close"``: the rank's own product x @ weight_shard, computed, so found
    to within rounding, its chunks by block and ``"whole"`` the product."""
    members = next(m for m in groups_of(scenario, world_size) if rank in m)
    args = [inputs(seed, scenario, function, r, len(members)) for r in members]
    me = members.index(rank)
    if function == "allgather_matmul":
        chunks = [a["x"] for a in args]
        return {"forward": {"exact": chunks, "own": me}, "backward": {"exact": chunks, "own": me}}
    product = args[me]["x"] @ args[me]["weight"]
    return {"forward": {"close": list(product.split(ROWS)), "own": None},
            "backward": {"exact": [a["grad"] for a in args], "own": me}}
