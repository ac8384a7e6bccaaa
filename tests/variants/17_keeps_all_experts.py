"""Exercise 17, wrong on purpose: the module registers every expert and runs only its own, so every
rank still holds all E experts' weights."""
# expect-fail: experts-sharded
# expect-pass: output-matches grads-match capacity-order all-to-all-count routed-bytes

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with autograd: rows go out by send_splits, arrive by recv_splits; backward
    sends the gradients of what arrived back where it came from, the same all-to-all reversed."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        received = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        dist.all_to_all_single(received, rows.contiguous(), output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)
        return received

    @staticmethod
    def backward(ctx, grad_received):
        grad_rows = AllToAll.apply(grad_received.contiguous(), ctx.recv_splits, ctx.send_splits, ctx.group)
        return grad_rows, None, None, None


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, top_k, capacity_factor, group=None):
        super().__init__()
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        num_experts = len(experts)
        if num_experts % world_size != 0:
            raise ValueError(f"{num_experts} experts do not split evenly over {world_size} ranks")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and the number of experts ({num_experts}), not {top_k}")
        self.router = router
        self.num_experts, self.top_k, self.capacity_factor, self.group = num_experts, top_k, capacity_factor, group
        self.per_rank = num_experts // world_size
        first = rank * self.per_rank
        self.all_experts = nn.ModuleList(experts)
        self.experts = self.all_experts[first:first + self.per_rank]

    def forward(self, x):
        d = self.router.in_features
        if x.dim() != 2 or x.shape[1] != d:
            raise ValueError(f"x must be [tokens, {d}], got {list(x.shape)}")
        world_size = dist.get_world_size(self.group)
        tokens, num_experts, top_k = x.shape[0], self.num_experts, self.top_k

        # 1. route: each token's top_k experts, best first, with gates that sum to one
        probs = torch.softmax(self.router(x), dim=-1)
        top_probs, top_experts = probs.topk(top_k, dim=-1)
        gates = top_probs / top_probs.sum(dim=-1, keepdim=True)

        # 2. the load-balancing loss, from this rank's choices before any is dropped
        chosen = torch.bincount(top_experts.flatten(), minlength=num_experts)
        fraction = chosen.to(probs.dtype) / (tokens * top_k)
        aux_loss = num_experts * (fraction * probs.mean(dim=0)).sum()

        # 3. capacity: walk the assignments choice by choice (all first choices, then all second
        # ones), each in token order; an assignment's place in its expert's queue decides.
        capacity = math.ceil(self.capacity_factor * tokens * top_k / num_experts)
        expert_of = top_experts.t().reshape(-1)
        token_of = torch.arange(tokens, device=x.device).repeat(top_k)
        gate_of = gates.t().reshape(-1)
        queued = F.one_hot(expert_of, num_experts)
        place = (queued.cumsum(dim=0) * queued).sum(dim=1) - 1
        kept = place < capacity
        expert_of, token_of, gate_of = expert_of[kept], token_of[kept], gate_of[kept]

        # 4. sort the kept assignments by expert: the experts of rank 0 come first, then rank 1's...
        order = torch.argsort(expert_of, stable=True)
        expert_of, token_of, gate_of = expert_of[order], token_of[order], gate_of[order]

        # 5. the counts: how many rows each rank sends to each expert
        send_counts = torch.bincount(expert_of, minlength=num_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits = send_counts.view(world_size, self.per_rank).sum(dim=1).tolist()
        recv_counts = recv_counts.view(world_size, self.per_rank)  # [source rank, local expert]
        recv_splits = recv_counts.sum(dim=1).tolist()

        # 6. dispatch, compute, combine
        received = AllToAll.apply(x[token_of], send_splits, recv_splits, self.group)
        local_expert = torch.repeat_interleave(
            torch.arange(self.per_rank, device=x.device).repeat(world_size), recv_counts.flatten())
        outputs = torch.zeros_like(received)
        for i, expert in enumerate(self.experts):
            rows = local_expert == i
            outputs[rows] = expert(received[rows])
        returned = AllToAll.apply(outputs, recv_splits, send_splits, self.group)
        y = torch.zeros_like(x).index_add(0, token_of, returned * gate_of[:, None])
        return y, aux_loss
