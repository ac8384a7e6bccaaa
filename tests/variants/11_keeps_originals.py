"""Exercise 11, broken: the slices and the gathering are right, but the unit's original parameters
are never taken away: the module keeps a full copy of the model on every rank, and the unit runs
through torch.func.functional_call with the gathered views instead."""
# expect-fail: sharded-between-steps

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import functional_call


class ShardedUnit(torch.nn.Module):
    """One unit: this rank's slice, gathered into a full buffer just while the unit computes."""

    def __init__(self, unit, rank, world_size):
        super().__init__()
        self.unit = unit
        self.world_size = world_size
        self.names = [name for name, p in unit.named_parameters() if p.requires_grad]
        params = [p for p in unit.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        n = math.ceil(numel / world_size)
        flat = F.pad(torch.cat([p.detach().reshape(-1) for p in params]), (0, n * world_size - numel))
        self.shard = torch.nn.Parameter(flat[rank * n:(rank + 1) * n].clone())
        self.shapes = [p.shape for p in params]
        for p in params:
            p.requires_grad_(False)  # the slice is what trains; these are left where they are
        self.full = torch.empty_like(flat, requires_grad=True)
        self.full.untyped_storage().resize_(0)
        self.full.register_post_accumulate_grad_hook(self._reduce)
        self.pending = None

    def gather(self):
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        dist.all_gather_single(self.full.data, self.shard.detach())

    def free(self):
        self.full.untyped_storage().resize_(0)

    def views(self):
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes):
            out[name] = self.full[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        return out

    def _reduce(self, full):
        out = torch.empty_like(self.shard)
        dist.reduce_scatter_single(out, full.grad)
        self.pending = out
        full.grad = None
        self.free()

    def forward(self, x):
        self.gather()
        y = functional_call(self.unit, self.views(), (x,))
        self.free()
        if y.requires_grad:
            y.register_hook(lambda grad: self.gather())
        return y


class FullyShardedDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.units = {}
        for name, unit in list(module.named_children()):
            self.units[name] = ShardedUnit(unit, dist.get_rank(), self.world_size)
            setattr(module, name, self.units[name])

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for unit in self.units.values():
            if unit.pending is not None:
                unit.shard.grad = unit.pending / self.world_size
                unit.pending = None

    def full_state_dict(self):
        state = {}
        with torch.no_grad():
            for unit_name, sharded in self.units.items():
                sharded.gather()
                full_values = {name: view.clone() for name, view in sharded.views().items()}
                sharded.free()
                for key, value in sharded.unit.state_dict().items():
                    state[f"{unit_name}.{key}"] = full_values.get(key, value).clone()
        return state
