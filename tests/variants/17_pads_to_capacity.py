"""Exercise 17, wrong on purpose: GShard's fixed-size dispatch. Each rank fills a [E, capacity, d]
buffer (zeros where an expert got fewer rows) and sends it with equal splits, so no counts need to be
exchanged. Right numbers, but every all-to-all moves E * capacity rows per rank whatever the routing:
with capacity_factor 6 that is 12 x 16 rows for 32 assignments."""
# expect-fail: routed-bytes
# expect-pass: output-matches grads-match aux-loss-matches capacity-order skewed-router all-to-all-count experts-sharded

import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, top_k, capacity_factor, group=None):
        super().__init__()
        self.world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if len(experts) % self.world_size:
            raise ValueError(f"{len(experts)} experts do not divide over {self.world_size} ranks")
        self.router, self.top_k, self.capacity_factor, self.num_experts = router, top_k, capacity_factor, len(experts)
        self.group = group if group is not None else dist.group.WORLD
        self.per_rank = len(experts) // self.world_size
        self.experts = nn.ModuleList(experts[rank * self.per_rank:(rank + 1) * self.per_rank])

    def forward(self, x):
        if x.dim() != 2 or x.shape[1] != self.router.in_features:
            raise ValueError(f"x should be [tokens, {self.router.in_features}], not {list(x.shape)}")
        tokens, d = x.shape
        E, k = self.num_experts, self.top_k
        probs = torch.softmax(self.router(x), -1)
        top_p, top_e = probs.topk(k, -1)
        gates = top_p / top_p.sum(-1, keepdim=True)
        aux = E * (F.one_hot(top_e, E).sum((0, 1)).to(x.dtype) / (tokens * k) * probs.mean(0)).sum()

        capacity = math.ceil(self.capacity_factor * tokens * k / E)
        expert_ids = top_e.t().reshape(-1)
        one_hot = F.one_hot(expert_ids, E)
        slot = (one_hot.cumsum(0) * one_hot).sum(1) - 1
        keep = slot < capacity
        token_ids = torch.arange(tokens).repeat(k)[keep]
        expert_ids, slot, gate = expert_ids[keep], slot[keep], gates.t().reshape(-1)[keep]

        # The dispatch tensor: [E, capacity, d], rows in their expert's slots.
        buffer = x.new_zeros(E * capacity, d).index_copy(0, expert_ids * capacity + slot, x[token_ids])
        received = dist_nn.all_to_all_single(torch.empty_like(buffer), buffer, group=self.group)
        received = received.view(self.world_size, self.per_rank, capacity, d)
        outputs = torch.stack([self.experts[i](received[:, i].reshape(-1, d)).view(self.world_size, capacity, d)
                               for i in range(self.per_rank)], dim=1)
        back = dist_nn.all_to_all_single(torch.empty_like(buffer), outputs.reshape(-1, d), group=self.group)
        y = torch.zeros_like(x).index_add(0, token_ids, back[expert_ids * capacity + slot] * gate[:, None])
        return y, aux
