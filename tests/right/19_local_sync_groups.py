"""Exercise 19, a right answer in another style: each rank makes only its own two groups, with
use_local_synchronization=True (torch then names a group by its ranks, so the members alone call
new_group); the loss is logged as a world-wide mean, and the state dict gathered as one flat buffer."""

import logging

logger = logging.getLogger(__name__)

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
    if not 0 < tp_size <= world_size or world_size % tp_size:
        raise ValueError(f"tp_size {tp_size} is not a divisor of world_size {world_size}")
    rank = dist.get_rank()
    first = rank - rank % tp_size
    tp_group = dist.new_group(list(range(first, first + tp_size)), use_local_synchronization=True)
    dp_group = dist.new_group(list(range(rank % tp_size, world_size, tp_size)), use_local_synchronization=True)
    return dp_group, tp_group


def train_2d(rank, world_size, tp_size, data, steps, lr):
    if not 0 < tp_size <= world_size or world_size % tp_size:
        raise ValueError(f"tp_size {tp_size} is not a divisor of world_size {world_size}")
    x_all, y_all = data
    n, dp = x_all.shape[0], world_size // tp_size
    if x_all.shape != (n, IN_FEATURES) or y_all.shape != (n, OUT_FEATURES) or n % dp:
        raise ValueError(f"bad data: inputs {tuple(x_all.shape)}, targets {tuple(y_all.shape)}, dp {dp}")

    dp_group, tp_group = make_groups(world_size, tp_size)
    model = TensorParallelMLP(*dense_layers(), tp_group)
    x, y = x_all[rank // tp_size::dp], y_all[rank // tp_size::dp]  # strided rows: rows d, d + dp, ...

    for step in range(steps):
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM,
                            group=dp_group)
            if dist.get_backend() != "nccl":
                p.grad /= dp
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # one number, for the log
        logger.info("step %d loss %.6f", step, mean_loss.item() / world_size)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)

    local = torch.cat([model.fc1_weight.detach().reshape(-1), model.fc1_bias.detach(),
                       model.fc2_weight.detach().t().reshape(-1)])
    flat = torch.empty(local.numel() * tp_size, dtype=local.dtype)
    dist.all_gather(list(flat.chunk(tp_size)), local, group=tp_group)
    hidden = HIDDEN // tp_size
    w1, b1, w2t = [], [], []
    for block in flat.chunk(tp_size):
        a, b, c = block.split([hidden * IN_FEATURES, hidden, hidden * OUT_FEATURES])
        w1.append(a.view(hidden, IN_FEATURES))
        b1.append(b)
        w2t.append(c.view(hidden, OUT_FEATURES))
    return {"fc1.weight": torch.cat(w1), "fc1.bias": torch.cat(b1), "fc2.weight": torch.cat(w2t).t().contiguous(),
            "fc2.bias": model.fc2_bias.detach().clone()}
