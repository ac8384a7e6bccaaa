"""Exercise 19, a right answer in another style: the groups from a DeviceMesh ("dp", "tp"), the shards from
a DataLoader with a DistributedSampler over the data-parallel ranks (shuffled anew each step, the same
seed on tensor-parallel peers), torch.optim.SGD, and the gradients averaged in hooks as backward
accumulates them, DDP-style."""

from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 32, 8
SEED = 19


def dense_layers() -> tuple[nn.Linear, nn.Linear]:
    """The whole fc1 and fc2 every rank starts from: the same seed everywhere, float64."""
    torch.manual_seed(SEED)
    fc1 = nn.Linear(IN_FEATURES, HIDDEN, dtype=torch.float64)
    fc2 = nn.Linear(HIDDEN, OUT_FEATURES, dtype=torch.float64)
    return fc1, fc2


class SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: Megatron's g, on the group given."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelMLP(nn.Module):
    """fc2(gelu(fc1(x))) split over tp_group: fc1 by output features (rows), fc2 by input
    features (columns), one all-reduce in forward. The input is the batch itself, so its
    gradient is never needed (exercise 12's f operator has nothing to do here)."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, tp_group):
        super().__init__()
        self.tp_group = tp_group
        tp_rank, tp_size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        if fc1.out_features % tp_size != 0:
            raise ValueError(f"HIDDEN = {fc1.out_features} is not divisible by tp_size = {tp_size}")
        block = fc1.out_features // tp_size
        rows = slice(tp_rank * block, (tp_rank + 1) * block)
        self.fc1_weight = nn.Parameter(fc1.weight.detach()[rows].clone())     # [HIDDEN / tp, IN]
        self.fc1_bias = nn.Parameter(fc1.bias.detach()[rows].clone())         # [HIDDEN / tp]
        self.fc2_weight = nn.Parameter(fc2.weight.detach()[:, rows].clone())  # [OUT, HIDDEN / tp]
        self.fc2_bias = nn.Parameter(fc2.bias.detach().clone())               # [OUT], whole on every rank

    def forward(self, x):
        hidden = F.gelu(F.linear(x, self.fc1_weight, self.fc1_bias))
        partial = F.linear(hidden, self.fc2_weight)
        # The bias after the sum, so that it is added once and not once per rank.
        return SumOverGroup.apply(partial, self.tp_group) + self.fc2_bias


def make_groups(world_size, tp_size):
    if tp_size < 1 or world_size % tp_size != 0:
        raise ValueError(f"cannot lay {world_size} ranks out as tp groups of {tp_size}")
    mesh = init_device_mesh("cpu", (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return mesh.get_group("dp"), mesh.get_group("tp")


def train_2d(rank, world_size, tp_size, data, steps, lr):
    if tp_size < 1 or world_size % tp_size != 0:
        raise ValueError(f"cannot lay {world_size} ranks out as tp groups of {tp_size}")
    dp_size = world_size // tp_size
    inputs, targets = data
    if inputs.dim() != 2 or inputs.shape[-1] != IN_FEATURES:
        raise ValueError(f"inputs: expected [N, {IN_FEATURES}], got {list(inputs.shape)}")
    if targets.shape != (len(inputs), OUT_FEATURES):
        raise ValueError(f"targets: expected [{len(inputs)}, {OUT_FEATURES}], got {list(targets.shape)}")
    if len(inputs) % dp_size:
        raise ValueError(f"{len(inputs)} rows do not split into {dp_size} equal shards")

    dp_group, tp_group = make_groups(world_size, tp_size)
    model = TensorParallelMLP(*dense_layers(), tp_group)

    def average_over_dp(param):
        dist.all_reduce(param.grad, group=dp_group)
        param.grad.div_(dp_size)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average_over_dp)

    dataset = TensorDataset(inputs, targets)
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=rank // tp_size, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=len(dataset) // dp_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    for epoch in range(steps):  # one batch per epoch: the whole of this rank's shard
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            optimizer.step()

    tp_world = dist.get_world_size(tp_group)
    state = {}
    for key, param, dim in (("fc1.weight", model.fc1_weight, 0), ("fc1.bias", model.fc1_bias, 0),
                            ("fc2.weight", model.fc2_weight, 1)):
        pieces = [torch.empty_like(param) for _ in range(tp_world)]
        dist.all_gather(pieces, param.detach(), group=tp_group)
        state[key] = torch.cat(pieces, dim=dim)
    state["fc2.bias"] = model.fc2_bias.detach().clone()
    return state
