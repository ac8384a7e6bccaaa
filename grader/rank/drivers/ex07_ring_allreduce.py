"""Exercise 07: ring_all_reduce from point-to-point messages: the drivers, run in each rank (the checks that
decide: grader/checks/ex07_ring_allreduce.py).

Call the learner's ring_all_reduce on a list of seeded tensors (the same list on every rank, each rank's
values drawn from its own seed) while recording every torch.distributed call it makes.
"""

from __future__ import annotations

import contextlib

import torch

from grader.rank import probes, rank_timeline
from grader.rank.child import describe_exception, RankContext


DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
INT_RANGE = 2**40  # large enough that a detour through float32 or float64 loses digits
BIG_NUMEL = 3 * 4 * 5 * 1009  # the tensor whose traffic is measured: splits evenly for W = 2..5
DRAWN_CASES = 16


def make_tensor(case: dict, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input for ``case``: seeded, so the grader can rebuild it."""
    generator = torch.Generator().manual_seed(case["seed"] * 1000 + rank)
    shape = tuple(case["shape"])
    dtype = DTYPES[case["dtype"]]
    if dtype == torch.int64:
        return torch.randint(-INT_RANGE, INT_RANGE, shape, generator=generator, dtype=dtype)
    return torch.randn(shape, generator=generator, dtype=dtype)


def fixed_cases(world_size: int) -> list[dict]:
    """Cases every grading tries, the awkward sizes included."""
    w = max(world_size, 2)
    shapes = [
        ("float32", [4 * w]),  # the plain case: four elements per chunk
        ("float32", [BIG_NUMEL]),  # the measured one
        ("float32", []),  # a scalar: one element, fewer than the ranks
        ("int64", [w - 1]),  # fewer elements than ranks: some chunks are empty
        ("float64", [3, w + 1]),  # not divisible by the world size
        ("int64", [2, 5, 7]),
    ]
    return [{"shape": shape, "dtype": dtype, "measure": shape == [BIG_NUMEL]} for dtype, shape in shapes]


def drawn_cases(count: int = DRAWN_CASES) -> list[dict]:
    """Shapes and dtypes drawn by Hypothesis, the same ones every time (derandomized)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    found: list[dict] = []

    @settings(max_examples=count, derandomize=True, database=None, phases=[Phase.generate],
              deadline=None, suppress_health_check=list(HealthCheck))
    @given(shape=st.lists(st.integers(1, 9), max_size=3), dtype=st.sampled_from(sorted(DTYPES)))
    def collect(shape, dtype):
        found.append({"shape": shape, "dtype": dtype, "measure": False})

    collect()
    return found


def region_name(case: dict) -> str:
    """What the timeline calls the ring of a measured case."""
    return f"the ring of {case['shape'][0]:,} {case['dtype']}"


def cases_for(world_size: int, drawn: list[dict]) -> list[dict]:
    cases = fixed_cases(world_size) + drawn
    return [{**case, "seed": index + 1} for index, case in enumerate(cases)]


@rank_timeline.traced
def ring_main(ctx: RankContext) -> dict:
    """Run ring_all_reduce on every case; return the tensors after it and the calls it made."""
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        return _observe(ctx)


def _observe(ctx: RankContext) -> dict:
    events: list = []
    out = []
    with probes.watch_collectives(events):
        ring_all_reduce = ctx.function("ring_all_reduce")
        for case in ctx.kwargs["cases"]:
            tensor = make_tensor(case, ctx.rank)
            first = len(events)
            try:
                with rank_timeline.region(region_name(case)) if case.get("measure") else contextlib.nullcontext():
                    returned = ring_all_reduce(tensor)
            except NotImplementedError:
                raise  # still the stub: the grading says so
            except Exception as exc:  # the observation; the cases after it are not run (peers may be mid-ring)
                out.append({"error": describe_exception(exc, ctx.learner_path),
                            "events": [dict(e) for e in events[first:]]})
                break
            out.append({
                "result": tensor.detach().clone(),
                "returned": type(returned).__name__,
                "events": [dict(e) for e in events[first:]],
            })
    return {"cases": out}
