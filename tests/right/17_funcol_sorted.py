"""Expert parallelism with torch's functional collectives: funcol.all_to_all_single_autograd carries
the rows and their gradients, every rank learns the whole [rank, expert] count matrix from one
all_gather_into_tensor of integers, the gates are a softmax over the top-k logits (the renormalised
probabilities, computed the other way round), and the capacity queue is a stable sort by
(expert, choice, token)."""

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


def all_to_all(rows, output_splits, input_splits, group):
    return funcol.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group)


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, top_k, capacity_factor, group=None):
        super().__init__()
        self.group = group if group is not None else dist.group.WORLD
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if len(experts) % world:
            raise ValueError(f"num_experts={len(experts)} is not a multiple of world_size={world}")
        self.num_experts, self.top_k, self.capacity_factor = len(experts), top_k, capacity_factor
        self.world, self.rank, self.local = world, rank, len(experts) // world
        self.gate = router
        self.experts = nn.ModuleDict({str(rank * self.local + i): experts[rank * self.local + i]
                                      for i in range(self.local)})

    def forward(self, hidden):
        if hidden.dim() != 2 or hidden.shape[-1] != self.gate.in_features:
            raise ValueError(f"hidden states of shape {tuple(hidden.shape)}; expected (tokens, {self.gate.in_features})")
        T, E, K = hidden.shape[0], self.num_experts, self.top_k
        logits = self.gate(hidden)
        top_logits, top_idx = logits.topk(K, dim=-1)
        gates = F.softmax(top_logits, dim=-1, dtype=hidden.dtype)
        probs = F.softmax(logits, dim=-1, dtype=hidden.dtype)
        load = F.one_hot(top_idx, E).to(hidden.dtype).mean(dim=0).sum(dim=0) / K
        aux_loss = E * torch.dot(load, probs.mean(dim=0))

        # Queue order: expert, then choice, then token; a stable sort by expert over choice-major rows.
        flat_expert = top_idx.T.flatten()
        flat_token = torch.arange(T).expand(K, T).flatten()
        flat_gate = gates.T.flatten()
        order = torch.sort(flat_expert, stable=True).indices
        flat_expert, flat_token, flat_gate = flat_expert[order], flat_token[order], flat_gate[order]
        per_expert = torch.bincount(flat_expert, minlength=E)
        starts = torch.cumsum(per_expert, 0) - per_expert
        rank_in_queue = torch.arange(len(flat_expert)) - starts[flat_expert]
        within = rank_in_queue < math.ceil(self.capacity_factor * T * K / E)
        flat_expert, flat_token, flat_gate = flat_expert[within], flat_token[within], flat_gate[within]

        counts = torch.bincount(flat_expert, minlength=E)
        matrix = torch.empty(self.world * E, dtype=counts.dtype)
        dist.all_gather_into_tensor(matrix, counts, group=self.group)
        matrix = matrix.view(self.world, self.world, self.local)  # [sender, receiver, local expert]
        send = matrix[self.rank].sum(-1).tolist()
        recv = matrix[:, self.rank].sum(-1).tolist()

        arrived = all_to_all(hidden[flat_token], recv, send, self.group)
        local_ids = torch.arange(self.local).repeat(self.world).repeat_interleave(matrix[:, self.rank].flatten())
        processed = torch.zeros_like(arrived)
        for i in range(self.local):
            where = (local_ids == i).nonzero().squeeze(1)
            processed = processed.index_copy(0, where, self.experts[str(self.rank * self.local + i)](arrived[where]))
        back = all_to_all(processed, send, recv, self.group)

        out = hidden.new_zeros(hidden.shape)
        out.index_add_(0, flat_token, back * flat_gate.unsqueeze(-1))
        return out, aux_loss
