"""Exercise 12, grader side: the dense layers and MLP on the same weights and inputs, and the bytes a rank may
hold."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.rank.drivers.ex12_tensor_parallel import block, build, build_uneven


def dense(scenario: str) -> dict:
    """The dense layers of a scenario run in this process: output, input gradient, parameter gradients."""
    data = build(scenario)
    x = data["x"].clone().requires_grad_(True)
    if scenario in ("column", "row"):
        full = data["full"]
        y = full(x)
        params = {"weight": full.weight, "bias": full.bias}
    else:
        fc1, fc2 = data["fc1"], data["fc2"]
        y = fc2(F.gelu(fc1(x)))
        params = {"fc1.weight": fc1.weight, "fc1.bias": fc1.bias, "fc2.weight": fc2.weight, "fc2.bias": fc2.bias}
    (y * data["g"]).sum().backward()
    grads = {name: p.grad.detach() for name, p in params.items() if p is not None}
    values = {name: p.detach() for name, p in params.items() if p is not None}
    return {"output": y.detach(), "input_grad": x.grad.detach(), "grads": grads, "values": values}


# Which dimension of each parameter is split: rows (0) or columns (1); None: the whole of it on every rank.
SPLIT = {
    "mlp": {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None},
    "no_bias": {"fc1.weight": 0, "fc2.weight": 1},
    "column": {"weight": 0, "bias": 0},
    "row": {"weight": 1, "bias": None},
}


def shard(tensor: torch.Tensor, dim: int | None, rank: int, world_size: int) -> torch.Tensor:
    if dim is None:
        return tensor
    return tensor.narrow(dim, block(tensor.shape[dim], rank, world_size).start, tensor.shape[dim] // world_size)


def dense_uneven(world_size: int) -> dict:
    """The uneven scenario's dense results, per class: output and input gradient (for the row layer, of
    its whole input), with the output gradients the ranks use."""
    data = build_uneven(world_size)
    out = {}
    for name, layers, x, g in (("ColumnParallelLinear", ("column",), data["x"], data["g_column"]),
                               ("RowParallelLinear", ("row",), data["x_row"], data["g"]),
                               ("ParallelMLP", ("fc1", "fc2"), data["x"], data["g"])):
        x = x.clone().requires_grad_(True)
        y = data[layers[0]](x) if len(layers) == 1 else data["fc2"](F.gelu(data["fc1"](x)))
        (y * g).sum().backward()
        out[name] = {"output": y.detach(), "input_grad": x.grad.detach()}
    return out


HELD_SLACK = 256  # bytes of small tensors a module may keep besides its weights (an index, a flag)


def held_limit(want: dict, world_size: int) -> tuple[int, int]:
    """(a 1/W share of the MLP's bytes with fc2's bias whole, the dense MLP's bytes)."""
    sizes = {name: value.numel() * value.element_size() for name, value in want["values"].items()}
    share = (sizes["fc1.weight"] + sizes["fc1.bias"] + sizes["fc2.weight"]) // world_size + sizes["fc2.bias"]
    return share, sum(sizes.values())
