"""Exercise 37, grader side: what each inference rank keeps of the trainer's weights (the slice the layout gives
it), and the bytes each trainer rank holds of what each inference rank keeps: what it should send there."""

from __future__ import annotations

import functools

import torch

from grader.rank.drivers.ex37_weight_sync import DTYPES, LAYOUTS, shapes, splits, trainer_rows, weights


def split_dim(name: str, layout: dict) -> int | None:
    """The dimension of parameter ``name`` the inference ranks split, or None (each keeps it whole): a
    column-parallel layer splits its weight and bias along dim 0 (its outputs); a row-parallel one its weight
    along dim 1 (its inputs), its bias replicated (vLLM's RowParallelLinear holds the whole bias and adds it on
    one rank, so that the all-reduced sum counts it once); a module the layout does not name is replicated."""
    module, _, leaf = name.rpartition(".")
    style = layout.get(module)
    if style == "colwise":
        return 0
    if style == "rowwise" and leaf == "weight":
        return 1
    return None


def inference_range(size: int, inference: int, j: int) -> tuple[int, int]:
    """The j-th inference rank's part [start, stop) of a split dimension of ``size`` (equal parts)."""
    return j * size // inference, (j + 1) * size // inference


def kept_ranges(shape: list[int], dim: int | None, inference: int, j: int) -> list[tuple[int, int]]:
    """The j-th inference rank's range of each dimension of a parameter of ``shape``."""
    ranges = [(0, size) for size in shape]
    if dim is not None:
        ranges[dim] = inference_range(shape[dim], inference, j)
    return ranges


def kept_slice(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return tensor[tuple(slice(a, b) for a, b in ranges)]


@functools.cache
def expected(world_size: int, split_index: int, scenario: str) -> dict[int, dict[str, torch.Tensor]]:
    """{inference rank (global): {parameter name: the slice it keeps}} for one push."""
    split = splits(world_size)[split_index]
    inference = split["inference"]
    full = weights(scenario, split_index, len(inference))
    layout = LAYOUTS[scenario]
    out = {}
    for j, rank in enumerate(inference):
        out[rank] = {name: kept_slice(tensor, kept_ranges(list(tensor.shape), split_dim(name, layout),
                                                          len(inference), j)).clone()
                     for name, tensor in full.items()}
    return out


def placement_words(name: str, scenario: str) -> str:
    """How the layout places a parameter, in words."""
    dim = split_dim(name, LAYOUTS[scenario])
    module = name.rpartition(".")[0]
    style = LAYOUTS[scenario].get(module)
    if dim is None:
        return f"replicated ({module} is {style}: its bias stays whole)" if style else "replicated"
    return f"{style}: split along dim {dim}"


def itemsize(scenario: str) -> int:
    return torch.empty(0, dtype=getattr(torch, DTYPES[scenario])).element_size()


@functools.cache
def pair_bytes(world_size: int, split_index: int, scenario: str) -> dict[tuple[int, int], int]:
    """{(trainer rank, inference rank): bytes}: the rows each trainer rank holds of what each inference rank
    keeps, over every parameter: exactly what it should send there."""
    split = splits(world_size)[split_index]
    trainers, inference = split["trainers"], split["inference"]
    size = itemsize(scenario)
    out = {(t, i): 0 for t in trainers for i in inference}
    for name, shape in shapes(len(inference)).items():
        dim = split_dim(name, LAYOUTS[scenario])
        for k, t in enumerate(trainers):
            t0, t1 = trainer_rows(shape[0], len(trainers), k)
            for j, i in enumerate(inference):
                ranges = kept_ranges(shape, dim, len(inference), j)
                rows = max(0, min(t1, ranges[0][1]) - max(t0, ranges[0][0]))
                rest = 1
                for a, b in ranges[1:]:
                    rest *= b - a
                out[(t, i)] += rows * rest * size
    return out


@functools.cache
def layout_bytes(world_size: int, split_index: int, scenario: str) -> int:
    """The bytes the inference layout holds, over every inference rank."""
    return sum(pair_bytes(world_size, split_index, scenario).values())


def kept_names(world_size: int, split_index: int, scenario: str, rank: int) -> set[str]:
    """The parameters rank ``rank`` keeps whole, and so may hold whole: on a trainer rank those whose every row
    it holds (all of them when it is the only one), on an inference rank those it keeps whole (the replicated
    ones; all of them when it is the only one)."""
    split = splits(world_size)[split_index]
    trainers, inference = split["trainers"], split["inference"]
    out = set()
    for name, shape in shapes(len(inference)).items():
        if rank in trainers:
            whole = trainer_rows(shape[0], len(trainers), trainers.index(rank)) == (0, shape[0])
        else:
            dim = split_dim(name, LAYOUTS[scenario])
            whole = dim is None or inference_range(shape[dim], len(inference), inference.index(rank)) == (0, shape[dim])
        if whole:
            out.add(name)
    return out
