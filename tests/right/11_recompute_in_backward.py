# Fully sharded data parallel without keeping anything for backward: each unit runs inside an
# autograd function that gathers the unit, computes under no_grad and frees it; backward gathers
# the unit again, recomputes its forward with gradients on (activation checkpointing), and
# reduce-scatters the parameter gradient straight into the slice's .grad. The children are
# replaced by wrapper modules; the deprecated collective names of torch < 2.13 are used.
import math

import torch
import torch.distributed as dist
from torch.func import functional_call


class _UnitStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, x, sharded):
        ctx.sharded = sharded
        ctx.save_for_backward(x)
        with torch.no_grad():
            full = sharded.gather()
            return functional_call(sharded.inner, sharded.views(full), (x,))

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        sharded = ctx.sharded
        full = sharded.gather().requires_grad_()
        x = x.detach().requires_grad_(ctx.needs_input_grad[1])
        with torch.enable_grad():
            out = functional_call(sharded.inner, sharded.views(full), (x,))
            wrt = [full, x] if x.requires_grad else [full]
            grads = torch.autograd.grad(out, wrt, grad_out)
        del full, out
        grad_shard = torch.empty_like(sharded.shard)
        dist.reduce_scatter_tensor(grad_shard, grads[0].contiguous())
        grad_shard /= dist.get_world_size()
        return grad_shard, (grads[1] if x.requires_grad else None), None


class ShardedChild(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        world, rank = dist.get_world_size(), dist.get_rank()
        trainable = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in trainable]
        self.shapes = [p.shape for _, p in trainable]
        total = sum(p.numel() for _, p in trainable)
        self.per_rank = math.ceil(total / world)
        flat = torch.zeros(self.per_rank * world, dtype=trainable[0][1].dtype, device=trainable[0][1].device)
        flat[:total] = torch.cat([p.detach().view(-1) for _, p in trainable])
        self.shard = torch.nn.Parameter(flat[rank * self.per_rank:(rank + 1) * self.per_rank].clone())
        for n in self.names:
            owner, _, attr = n.rpartition(".")
            delattr(inner.get_submodule(owner), attr)
            setattr(inner.get_submodule(owner), attr, torch.empty(0))  # a placeholder functional_call swaps out

    def gather(self):
        full = torch.empty(self.per_rank * dist.get_world_size(), dtype=self.shard.dtype, device=self.shard.device)
        dist.all_gather_into_tensor(full, self.shard.detach())
        return full

    def views(self, full):
        out, start = {}, 0
        for n, shape in zip(self.names, self.shapes):
            out[n] = full[start:start + shape.numel()].view(shape)
            start += shape.numel()
        return out

    def forward(self, x):
        return _UnitStep.apply(self.shard, x, self)


class FullyShardedDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        self.module = module
        self.sharded = {}
        for name, child in list(module.named_children()):
            self.sharded[name] = ShardedChild(child)
            setattr(module, name, self.sharded[name])

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass  # each slice's .grad was averaged in its unit's backward

    def full_state_dict(self):
        state = {}
        with torch.no_grad():
            for name, child in self.sharded.items():
                full = child.views(child.gather())
                for key, value in {**child.inner.state_dict(), **full}.items():
                    state[f"{name}.{key}"] = value.clone()
        return state
