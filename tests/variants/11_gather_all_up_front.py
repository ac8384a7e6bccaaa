"""Exercise 11, broken: forward gathers every unit before running the module and frees them all
once the gradients are reduce-scattered: correct values, but the whole model's parameters are in
memory for the whole step, and backward never gathers."""
# expect-fail: two-units-at-a-time

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


class FullyShardedDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        rank = dist.get_rank()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

        self.shards = torch.nn.ParameterList()
        self.flats = []
        self.layouts = []
        for unit_name, unit in module.named_children():
            params = [(name, p) for name, p in unit.named_parameters() if p.requires_grad]
            numel = sum(p.numel() for _, p in params)
            n = math.ceil(numel / self.world_size)
            flat = F.pad(torch.cat([p.detach().flatten() for _, p in params]), (0, n * self.world_size - numel))
            self.shards.append(torch.nn.Parameter(flat[rank * n:(rank + 1) * n].clone()))
            full = torch.empty_like(flat, requires_grad=True)
            full.untyped_storage().resize_(0)
            self.flats.append(full)
            self.layouts.append((unit_name, unit, [(name, p.shape) for name, p in params]))
            for name, _ in params:
                owner, _, attr = name.rpartition(".")
                delattr(unit.get_submodule(owner), attr)

    def _gather_all(self):
        for full, shard in zip(self.flats, self.shards):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            dist.all_gather_single(full.data, shard.detach())

    def _free_all(self):
        for full in self.flats:
            full.untyped_storage().resize_(0)

    def forward(self, *args, **kwargs):
        self._gather_all()
        for (_, unit, params), full in zip(self.layouts, self.flats):
            offset = 0
            for name, shape in params:
                owner, _, attr = name.rpartition(".")
                setattr(unit.get_submodule(owner), attr, full[offset:offset + shape.numel()].view(shape))
                offset += shape.numel()
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for full, shard in zip(self.flats, self.shards):
            grad = torch.empty_like(shard)
            dist.reduce_scatter_single(grad, full.grad)
            shard.grad = grad / self.world_size
            full.grad = None
        self._free_all()

    def full_state_dict(self):
        state = {k: v.clone() for k, v in self.module.state_dict().items()}
        with torch.no_grad():
            self._gather_all()
            for (unit_name, _, params), full in zip(self.layouts, self.flats):
                offset = 0
                for name, shape in params:
                    state[f"{unit_name}.{name}"] = full[offset:offset + shape.numel()].view(shape).clone()
                    offset += shape.numel()
            self._free_all()
        return state
