"""DTensors as the grader reads them (exercises 31-33, 36): what a rank should hold of a whole tensor by
its placements.

A rank records its DTensors with :mod:`grader.rank.drivers.shared.dtensors` (``describe``: placements,
the mesh's names, shape and rank layout, this rank's coordinate, global and local shape). Here
:func:`parse` reads a placement's text, :func:`expected_local` cuts a whole tensor as the
placements of a :func:`describe` record say, :func:`find` looks a name up through a wrapper's prefix.
Placements are read as DTensor defines them: mesh dims in order, each Shard(d) taking its coordinate's
torch.chunk along d of what the dims before it left; a _StridedShard(d, sf) (FSDP's on "dp" when tensor
parallelism already split d) first cuts d in sf pieces and takes its chunk of each.
"""

from __future__ import annotations

import re

import torch


def find(named: dict, key: str):
    """``named[key]``, or the entry whose name ends with ``.key`` (a wrapper's prefix still finds it)."""
    if key in named:
        return named[key]
    return next((v for k, v in named.items() if k.endswith("." + key)), None)


def parse(text: str) -> tuple:
    """("shard", dim), ("strided", dim, split_factor), ("replicate",) or ("other", text)."""
    if match := re.fullmatch(r"Shard\(dim=(-?\d+)\)", text):
        return ("shard", int(match.group(1)))
    if match := re.fullmatch(r"_StridedShard\(dim=(-?\d+), sf=(\d+)\)", text):
        return ("strided", int(match.group(1)), int(match.group(2)))
    if text == "Replicate()":
        return ("replicate",)
    return ("other", text)


def chunk(x: torch.Tensor, n: int, dim: int, index: int) -> torch.Tensor:
    """torch.chunk(x, n, dim)[index], or an empty piece where chunk gives fewer than n."""
    chunks = torch.chunk(x, n, dim=dim)
    if index < len(chunks):
        return chunks[index]
    shape = list(x.shape)
    shape[dim] = 0
    return x.new_empty(shape)


def expected_local(full: torch.Tensor, entry: dict) -> torch.Tensor | None:
    """What a rank holds of ``full`` when placed as ``entry`` (a :func:`describe` record) says; None for a
    placement like Partial."""
    if not entry.get("dtensor"):
        return full
    x = full
    for placement, size, coord in zip(entry["placements"], entry["mesh_shape"], entry["coord"]):
        kind = parse(placement)
        if kind[0] in ("shard", "strided"):
            dim = kind[1] % full.dim()
            pieces = torch.chunk(x, kind[2], dim=dim) if kind[0] == "strided" else (x,)
            x = torch.cat([chunk(piece, size, dim, coord) for piece in pieces], dim=dim)
        elif kind[0] != "replicate":
            return None
    return x
