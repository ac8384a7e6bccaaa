"""Exercise 19, wrong on purpose: the shard is picked by tp rank (rank % tp_size) instead of dp
rank: data-parallel peers train on the same rows, and half the batch is never seen."""
# expect-fail: dp-shards tp-same-batch matches-single

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


def check_sizes(world_size: int, tp_size: int) -> int:
    """The data-parallel size, once tp_size is known to divide world_size."""
    if tp_size < 1 or world_size % tp_size != 0:
        raise ValueError(f"tp_size = {tp_size} does not divide world_size = {world_size}")
    return world_size // tp_size


def make_groups(world_size, tp_size):
    dp_size = check_sizes(world_size, tp_size)
    rank = dist.get_rank()
    # Every rank makes every group, in the same order, members or not: groups are told apart by
    # the order they are made in.
    tp_groups = [dist.new_group(list(range(row * tp_size, (row + 1) * tp_size))) for row in range(dp_size)]
    dp_groups = [dist.new_group(list(range(column, world_size, tp_size))) for column in range(tp_size)]
    return dp_groups[rank % tp_size], tp_groups[rank // tp_size]


def check_data(data, dp_size: int) -> None:
    inputs, targets = data
    if inputs.dim() != 2 or inputs.shape[1] != IN_FEATURES:
        raise ValueError(f"inputs must be [N, {IN_FEATURES}], not {list(inputs.shape)}")
    if targets.dim() != 2 or targets.shape != (inputs.shape[0], OUT_FEATURES):
        raise ValueError(f"targets must be [{inputs.shape[0]}, {OUT_FEATURES}], not {list(targets.shape)}")
    if inputs.shape[0] % dp_size != 0:
        raise ValueError(f"N = {inputs.shape[0]} rows do not split into {dp_size} equal data-parallel shards")


def gather_state_dict(model: TensorParallelMLP, tp_group) -> dict:
    """The whole model from this rank's tensor-parallel group: fc1's blocks are rows, fc2's columns."""
    tp_size = dist.get_world_size(tp_group)

    def gather(block, dim):
        blocks = [torch.empty_like(block) for _ in range(tp_size)]
        dist.all_gather(blocks, block.detach().contiguous(), group=tp_group)
        return torch.cat(blocks, dim=dim).cpu()

    return {
        "fc1.weight": gather(model.fc1_weight, 0),
        "fc1.bias": gather(model.fc1_bias, 0),
        "fc2.weight": gather(model.fc2_weight, 1),
        "fc2.bias": model.fc2_bias.detach().cpu().clone(),
    }


def train_2d(rank, world_size, tp_size, data, steps, lr):
    dp_size = check_sizes(world_size, tp_size)
    check_data(data, dp_size)
    dp_group, tp_group = make_groups(world_size, tp_size)
    model = TensorParallelMLP(*dense_layers(), tp_group)

    # This rank's shard: its tensor-parallel peers have the same dp rank, so they take the same rows.
    inputs, targets = data
    dp_rank = rank % tp_size
    shard = inputs.shape[0] // dp_size
    x = inputs[dp_rank * shard:(dp_rank + 1) * shard]
    y = targets[dp_rank * shard:(dp_rank + 1) * shard]

    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        # Average over the data-parallel group only: the tensor-parallel peers hold other blocks
        # of the weights, and the same gradient of the replicated fc2 bias.
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group)
            p.grad /= dp_size
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad

    return gather_state_dict(model, tp_group)
