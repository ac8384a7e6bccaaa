"""Exercise 19: data and tensor parallelism together, by hand: process subgroups.

Exercise 03 gave every rank the whole model and a batch of its own; exercise 12 split one
model over every rank, all of them on the same batch. A job on W = dp x tp ranks does both:
the ranks are laid out as a grid of dp rows and tp columns.

    world_size = 4, tp_size = 2          rank:       0   1   2   3
                                         tp rank:    0   1   0   1    (rank % tp_size)
                                         dp rank:    0   0   1   1    (rank // tp_size)

    tensor-parallel groups: consecutive ranks    [0, 1]  [2, 3]
    data-parallel groups:   one rank of each     [0, 2]  [1, 3]

The ranks of a tensor-parallel group hold the blocks of one copy of the model and compute
each layer together (the MLP's all-reduce, in every forward): they must see the same batch.
The ranks of a data-parallel group hold the same block of different copies, each copy
training on its own shard of the batch; the gradients of a block are averaged among the
ranks that hold it, the data-parallel group. Averaged over the whole world they would mix
different blocks of the weights.

torch.distributed makes a subgroup with dist.new_group(ranks). Every rank of the job calls it
for every group, its own and the others, in the same order: groups are told apart by the
order they are made in, and a rank that skips one is out of step for the next. A rank that is
not a member gets a placeholder back (dist.GroupMember.NON_GROUP_MEMBER). Each collective
takes the group it runs in: dist.all_reduce(t, group=tp_group).

    make_groups(world_size, tp_size) -> (dp_group, tp_group)
        Called on every rank after the process group is initialized. Makes every tensor-
        parallel group (ranks g * tp_size ... g * tp_size + tp_size - 1) and every data-parallel
        group (ranks t, t + tp_size, t + 2 * tp_size, ...) with dist.new_group, and returns this
        rank's two. tp_size that is not a positive divisor of world_size: ValueError saying
        both, raised before any group is made.

    train_2d(rank, world_size, tp_size, data, steps, lr) -> dict
        data = (inputs, targets), the global batch, the same on every rank: inputs
        [N, IN_FEATURES] and targets [N, OUT_FEATURES], float64.
        1. make_groups(world_size, tp_size); the model: TensorParallelMLP(*dense_layers(), tp_group).
        2. This rank's shard of the batch: one of dp = world_size // tp_size equal, disjoint
           shards of the N rows, shard number dp rank (contiguous blocks, DistributedSampler's
           strided rows, a new split each step: any, as long as tensor-parallel peers take the
           same rows and a data-parallel group's shards cover the batch).
        3. steps steps of plain SGD on the mean squared error over all N rows
           (F.mse_loss(out, y) of the whole batch): forward and backward of this rank's shard,
           the gradients averaged over dp_group and over nothing else, then p -= lr * p.grad.
        4. Return the whole model's state dict on every rank: {"fc1.weight": [HIDDEN,
           IN_FEATURES], "fc1.bias": [HIDDEN], "fc2.weight": [OUT_FEATURES, HIDDEN], "fc2.bias":
           [OUT_FEATURES]}, CPU tensors, the blocks gathered over the tensor-parallel group (the
           data-parallel peers already hold the same values).
        Bad input gets a ValueError on every rank, before any collective: inputs not
        [N, IN_FEATURES], targets not [N, OUT_FEATURES], N not divisible by dp (or shard such
        an N unevenly and weight each shard's loss by its rows: a right result passes too).

The grader starts the processes and the process group (gloo on CPU) and calls train_2d on
every rank with world size 4 (dp 2 x tp 2) and 2 (dp 2 x tp 1). It records the ranks of each
group make_groups returns, every dist.new_group call, the group of every collective, the
batch each forward saw and each rank's blocks before each step, and trains the dense MLP in
one process on the whole batch.

Replace each `raise NotImplementedError` below; keep the names and signatures, and the model.
Grade it with:  ddp-grade exercises/19_data_tensor_parallel.py      (stuck? ddp-grade hint 19)
"""

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
    dp_rank = rank // tp_size
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
