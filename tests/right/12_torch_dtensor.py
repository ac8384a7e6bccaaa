"""The layers built with torch's own tensor parallelism: ColwiseParallel and RowwiseParallel on a
one-dimensional DeviceMesh, whose parameters are DTensors (each rank stores its shard)."""

import copy

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _parallel(full: nn.Linear, split: int, style) -> nn.Linear:
    world_size = dist.get_world_size()
    if split % world_size:
        raise ValueError(f"{split} features do not split evenly over {world_size} ranks")
    mesh = init_device_mesh(full.weight.device.type, (world_size,))
    return parallelize_module(copy.deepcopy(full), mesh, style)


def ColumnParallelLinear(full: nn.Linear) -> nn.Linear:
    return _parallel(full, full.out_features, ColwiseParallel())


def RowParallelLinear(full: nn.Linear) -> nn.Linear:
    return _parallel(full, full.in_features, RowwiseParallel())


class ParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1 = ColumnParallelLinear(fc1)
        self.fc2 = RowParallelLinear(fc2)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
