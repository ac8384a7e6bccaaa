"""Exercise 11, broken: every parameter is padded and sharded on its own, and gathered and
reduce-scattered on its own: the right values, but one collective per parameter instead of one per
unit (a Linear's weight and bias make two small messages where one would do)."""
# expect-fail: gathers-per-unit reduce-scatter-grads

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


class FullyShardedDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

        self.shards = torch.nn.ParameterList()
        self.pieces = {}  # unit -> [(key, owner module, attribute, shape, shard index, full buffer)]
        self.pending = []
        for unit_name, unit in module.named_children():
            pieces = []
            for name, p in list(unit.named_parameters()):
                if not p.requires_grad:
                    continue
                n = math.ceil(p.numel() / self.world_size)
                flat = F.pad(p.detach().reshape(-1), (0, n * self.world_size - p.numel()))
                self.shards.append(torch.nn.Parameter(flat[self.rank * n:(self.rank + 1) * n].clone()))
                full = torch.empty_like(flat, requires_grad=True)
                full.untyped_storage().resize_(0)
                owner, _, attr = name.rpartition(".")
                delattr(unit.get_submodule(owner), attr)
                pieces.append((f"{unit_name}.{name}", unit.get_submodule(owner), attr, p.shape,
                               len(self.shards) - 1, full))
                full.register_post_accumulate_grad_hook(lambda full, k=len(self.shards) - 1: self._reduce(k, full))
            self.pieces[unit] = pieces
            unit.register_forward_pre_hook(self._before)
            unit.register_forward_hook(self._after)

    def _gather(self, unit):
        for _, _, _, _, k, full in self.pieces[unit]:
            full.untyped_storage().resize_(full.numel() * full.element_size())
            dist.all_gather_single(full.data, self.shards[k].detach())

    def _free(self, unit):
        for *_, full in self.pieces[unit]:
            full.untyped_storage().resize_(0)

    def _before(self, unit, args):
        self._gather(unit)
        for _, owner, attr, shape, _, full in self.pieces[unit]:
            setattr(owner, attr, full[:shape.numel()].view(shape))

    def _after(self, unit, args, output):
        self._free(unit)
        if output.requires_grad:
            output.register_hook(lambda grad: self._gather(unit))

    def _reduce(self, k, full):
        out = torch.empty_like(self.shards[k])
        dist.reduce_scatter_single(out, full.grad)
        self.pending.append((k, out))
        full.grad = None
        full.untyped_storage().resize_(0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for k, out in self.pending:
            self.shards[k].grad = out / self.world_size
        self.pending = []

    def full_state_dict(self):
        state = {k: v.clone() for k, v in self.module.state_dict().items()}
        with torch.no_grad():
            for unit, pieces in self.pieces.items():
                self._gather(unit)
                for key, _, _, shape, _, full in pieces:
                    state[key] = full[:shape.numel()].view(shape).clone()
                self._free(unit)
        return state
