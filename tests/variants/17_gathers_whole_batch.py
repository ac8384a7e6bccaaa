"""Exercise 17, wrong on purpose: no all-to-all. Every rank all-gathers every rank's tokens, gates and
choices, runs its own experts on every token routed to them, and a reduce-scatter sums each token's
results back on its rank. Right numbers and gradients, but every rank receives the whole batch."""
# expect-fail: all-to-all-count routed-bytes
# expect-pass: output-matches grads-match aux-loss-matches capacity-order skewed-router experts-sharded

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, top_k, capacity_factor, group=None):
        super().__init__()
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if len(experts) % world_size:
            raise ValueError(f"{len(experts)} experts over {world_size} ranks")
        self.router, self.top_k, self.capacity_factor = router, top_k, capacity_factor
        self.group = group if group is not None else dist.group.WORLD
        self.num_experts = len(experts)
        self.per_rank = len(experts) // world_size
        self.first = rank * self.per_rank
        self.experts = nn.ModuleList(experts[self.first:self.first + self.per_rank])

    def forward(self, x):
        if x.dim() != 2 or x.shape[1] != self.router.in_features:
            raise ValueError(f"bad x shape {list(x.shape)}")
        tokens, E, k = x.shape[0], self.num_experts, self.top_k
        probs = torch.softmax(self.router(x), dim=-1)
        top_p, top_e = probs.topk(k, dim=-1)
        gates = top_p / top_p.sum(-1, keepdim=True)
        aux = E * (torch.bincount(top_e.flatten(), minlength=E).to(x.dtype) / (tokens * k) * probs.mean(0)).sum()

        capacity = math.ceil(self.capacity_factor * tokens * k / E)
        order = top_e.t().reshape(-1)
        one_hot = F.one_hot(order, E)
        keep = (((one_hot.cumsum(0) * one_hot).sum(1) - 1) < capacity).view(k, tokens).t()
        gates = gates * keep

        # Everyone gets everything.
        all_x = funcol.all_gather_tensor_autograd(x, 0, self.group)
        all_gates = funcol.all_gather_tensor_autograd(gates, 0, self.group)
        all_e = funcol.all_gather_tensor(top_e, 0, self.group)
        partial = torch.zeros_like(all_x)
        for i, expert in enumerate(self.experts):
            hit = all_e == self.first + i
            rows = hit.any(-1)
            weight = (all_gates * hit).sum(-1, keepdim=True)
            partial = partial.index_add(0, rows.nonzero().flatten(), weight[rows] * expert(all_x[rows]))
        y = funcol.reduce_scatter_tensor_autograd(partial, "sum", 0, self.group)
        return y, aux
