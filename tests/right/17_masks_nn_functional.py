"""Expert parallelism written with masks instead of a sort: the kept assignments are collected expert
by expert (a boolean mask per expert, in queue order), the all-to-alls are
torch.distributed.nn.functional.all_to_all_single (autograd built in), the counts travel as a
[world, experts per rank] table, and the capacity walk is a Python loop over choices."""

import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
from torch import nn


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, top_k, capacity_factor, group=None):
        super().__init__()
        self.group = group
        self.world = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        assert len(experts) % self.world == 0, f"cannot split {len(experts)} experts over {self.world} ranks"
        self.n_local = len(experts) // self.world
        self.n_experts = len(experts)
        self.router = router
        self.local_experts = nn.ModuleList([experts[self.me * self.n_local + i] for i in range(self.n_local)])
        self.k = top_k
        self.cf = capacity_factor

    def forward(self, x):
        if x.ndim != 2:
            raise ValueError(f"expected 2-D tokens, got {x.ndim}-D")
        if x.size(1) != self.router.weight.size(1):
            raise ValueError(f"expected {self.router.weight.size(1)} features, got {x.size(1)}")
        n, E = x.size(0), self.n_experts

        logits = self.router(x)
        probs = logits.softmax(dim=1)
        weights, chosen = torch.topk(probs, self.k, dim=1)
        weights = weights / weights.sum(dim=1, keepdim=True)

        density = torch.zeros(E, dtype=x.dtype)
        for j in range(self.k):
            density += torch.nn.functional.one_hot(chosen[:, j], E).to(x.dtype).sum(0)
        aux = (density / (n * self.k) * probs.mean(0)).sum() * E

        cap = math.ceil(self.cf * n * self.k / E)
        kept = torch.zeros_like(chosen, dtype=torch.bool)
        used = [0] * E
        for j in range(self.k):
            for t in range(n):
                e = int(chosen[t, j])
                if used[e] < cap:
                    used[e] += 1
                    kept[t, j] = True

        # Expert by expert, the kept (token, choice) pairs: experts in order means ranks in order.
        token_lists, weight_lists, counts = [], [], []
        for e in range(E):
            mask = (chosen == e) & kept
            t_idx, j_idx = mask.nonzero(as_tuple=True)
            token_lists.append(t_idx)
            weight_lists.append(weights[t_idx, j_idx])
            counts.append(len(t_idx))
        token_idx = torch.cat(token_lists)
        gate = torch.cat(weight_lists)

        table = torch.tensor(counts, dtype=torch.int64).view(self.world, self.n_local)
        incoming = torch.empty_like(table)
        dist.all_to_all_single(incoming, table, group=self.group)
        send_sizes = table.sum(1).tolist()
        recv_sizes = incoming.sum(1).tolist()

        inbox = dnn.all_to_all_single(x.new_empty(sum(recv_sizes), x.size(1)), x[token_idx],
                                      recv_sizes, send_sizes, group=self.group or dist.group.WORLD)
        pieces, start = [], 0
        for src in range(self.world):
            for i in range(self.n_local):
                count = int(incoming[src, i])
                pieces.append(self.local_experts[i](inbox[start:start + count]))
                start += count
        results = torch.cat(pieces) if pieces else inbox
        outbox = dnn.all_to_all_single(x.new_empty(sum(send_sizes), x.size(1)), results,
                                       send_sizes, recv_sizes, group=self.group or dist.group.WORLD)

        y = torch.zeros_like(x)
        y = y.index_add(0, token_idx, outbox * gate.unsqueeze(1))
        return y, aux
