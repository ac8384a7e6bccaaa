"""Exercise 19, a right answer in another style: both kinds of group from dist.new_subgroups_by_enumeration
(which loops over every group on every rank and hands back this rank's), the data-parallel rank and size
read from the group itself, and the gradients averaged in one flat buffer per step."""

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
    if tp_size <= 0 or world_size % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide world_size={world_size}")
    rows = [list(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]
    columns = [list(range(offset, world_size, tp_size)) for offset in range(tp_size)]
    tp_group, _ = dist.new_subgroups_by_enumeration(rows)
    dp_group, _ = dist.new_subgroups_by_enumeration(columns)
    return dp_group, tp_group


def _validate(inputs, targets, dp_size):
    if inputs.ndim != 2 or inputs.size(1) != IN_FEATURES:
        raise ValueError(f"expected inputs of shape [N, {IN_FEATURES}], got {tuple(inputs.shape)}")
    if tuple(targets.shape) != (inputs.size(0), OUT_FEATURES):
        raise ValueError(f"expected targets of shape [{inputs.size(0)}, {OUT_FEATURES}], got {tuple(targets.shape)}")
    if inputs.size(0) % dp_size:
        raise ValueError(f"{inputs.size(0)} samples cannot be split evenly across {dp_size} data-parallel ranks")


def _all_reduce_flat(grads, group):
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def train_2d(rank, world_size, tp_size, data, steps, lr):
    if tp_size <= 0 or world_size % tp_size:
        raise ValueError(f"tp_size={tp_size} must divide world_size={world_size}")
    inputs, targets = data
    _validate(inputs, targets, world_size // tp_size)

    dp_group, tp_group = make_groups(world_size, tp_size)
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    tp_size = dist.get_world_size(tp_group)
    model = TensorParallelMLP(*dense_layers(), tp_group)
    params = list(model.parameters())

    per_rank = inputs.size(0) // dp_size
    mine = torch.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    x, y = inputs.index_select(0, mine), targets.index_select(0, mine)

    for it in range(steps):
        for p in params:
            p.grad = None
        loss = F.mse_loss(model(x), y)
        loss.backward()
        _all_reduce_flat([p.grad for p in params], dp_group)
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-lr)

    def gathered(t, dim):
        out = [torch.zeros_like(t) for _ in range(tp_size)]
        dist.all_gather(out, t.detach().contiguous(), group=tp_group)
        return torch.cat(out, dim)

    return {
        "fc1.weight": gathered(model.fc1_weight, 0),
        "fc1.bias": gathered(model.fc1_bias, 0),
        "fc2.weight": gathered(model.fc2_weight, 1),
        "fc2.bias": model.fc2_bias.detach().clone(),
    }
