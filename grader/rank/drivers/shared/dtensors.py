"""DTensors as a rank records them (exercises 31-33, 36): what this rank holds of a parameter or an output.

:func:`local` (a DTensor's local piece, a plain tensor whole, on the CPU), :func:`local_values` (every
parameter's), :func:`describe` (plain data: DTensor or not, placements, the mesh's names, shape and rank
layout, this rank's coordinate there, global and local shape). The grader reads these records with
:mod:`grader.rank.drivers.shared.dtensors`.
"""

from __future__ import annotations

import torch
from torch import nn


def _is_dtensor(value) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local(value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a plain tensor whole), detached, copied to the CPU."""
    piece = value.to_local() if _is_dtensor(value) else value
    return piece.detach().to("cpu", copy=True)


def local_values(module: nn.Module) -> dict:
    """Each parameter's values on this rank, by name: a DTensor's local shard, a plain tensor whole."""
    return {name: local(p) for name, p in module.named_parameters()}


def describe(value: torch.Tensor) -> dict:
    """A parameter or an output as it is on this rank, as plain data."""
    out = {"kind": type(value).__name__, "dtensor": _is_dtensor(value), "shape": list(value.shape),
           "dtype": str(value.dtype).removeprefix("torch.")}
    if out["dtensor"]:
        mesh = value.device_mesh
        out.update(placements=[repr(p) for p in value.placements], mesh_names=list(mesh.mesh_dim_names or []),
                   mesh_shape=list(mesh.shape), coord=mesh.get_coordinate(), layout=mesh.mesh.tolist(),
                   local_shape=list(value.to_local().shape))
    else:
        out["local_shape"] = list(value.shape)
    return out
