"""Exercise 11, broken: the all-gather is an autograd function (its backward reduce-scatters the
gradient), and the unit's attributes are cleared after forward. It looks freed, but autograd saved
every unit's gathered weights for backward, so all of them stay in memory until backward, and they
are never gathered again."""
# expect-fail: two-units-at-a-time gathers-per-unit

import math

import torch
import torch.distributed as dist


class GatherParams(torch.autograd.Function):
    """Forward: all-gather the slices into the full buffer. Backward: reduce-scatter its gradient."""

    @staticmethod
    def forward(ctx, shard, world_size):
        ctx.world_size = world_size
        full = torch.empty(shard.numel() * world_size, dtype=shard.dtype, device=shard.device)
        dist.all_gather_single(full, shard.contiguous())
        return full

    @staticmethod
    def backward(ctx, grad_full):
        grad_shard = torch.empty(grad_full.numel() // ctx.world_size, dtype=grad_full.dtype,
                                 device=grad_full.device)
        dist.reduce_scatter_single(grad_shard, grad_full.contiguous())
        return grad_shard / ctx.world_size, None


class FullyShardedDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

        self.shards = torch.nn.ParameterList()
        self.units = []  # (unit name, unit, [(parameter name, shape, offset)])
        for unit_name, unit in module.named_children():
            trainable = [(name, p) for name, p in unit.named_parameters() if p.requires_grad]
            if not trainable:
                continue
            numel = sum(p.numel() for _, p in trainable)
            size = math.ceil(numel / self.world_size)
            flat = torch.zeros(size * self.world_size, dtype=trainable[0][1].dtype)
            flat[:numel] = torch.cat([p.detach().reshape(-1) for _, p in trainable])
            self.shards.append(torch.nn.Parameter(flat[self.rank * size:(self.rank + 1) * size].clone()))
            layout, offset = [], 0
            for name, p in trainable:
                owner, _, attr = name.rpartition(".")
                delattr(unit.get_submodule(owner), attr)
                layout.append((name, p.shape, offset))
                offset += p.numel()
            index = len(self.units)
            self.units.append((unit_name, unit, layout))
            unit.register_forward_pre_hook(lambda unit, args, i=index: self._materialize(i))
            unit.register_forward_hook(lambda unit, args, output, i=index: self._release(i))

    def _materialize(self, i):
        _, unit, layout = self.units[i]
        full = GatherParams.apply(self.shards[i], self.world_size)
        for name, shape, offset in layout:
            owner, _, attr = name.rpartition(".")
            setattr(unit.get_submodule(owner), attr, full[offset:offset + shape.numel()].view(shape))

    def _release(self, i):
        _, unit, layout = self.units[i]
        for name, _, _ in layout:
            owner, _, attr = name.rpartition(".")
            setattr(unit.get_submodule(owner), attr, None)  # "free" the full parameters

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass  # GatherParams.backward already reduce-scattered and averaged each slice's gradient

    def full_state_dict(self):
        state = {key: value.clone() for key, value in self.module.state_dict().items()}
        with torch.no_grad():
            for i, (unit_name, _, layout) in enumerate(self.units):
                full = torch.empty(self.shards[i].numel() * self.world_size, dtype=self.shards[i].dtype)
                dist.all_gather_single(full, self.shards[i].detach())
                for name, shape, offset in layout:
                    state[f"{unit_name}.{name}"] = full[offset:offset + shape.numel()].view(shape).clone()
        return state
