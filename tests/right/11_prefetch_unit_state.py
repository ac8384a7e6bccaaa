"""Fully sharded data parallel in the style of FSDP2: one small state object per unit, the ranks
read from the environment as torchrun sets them, the next unit's all-gather started early
(asynchronously) so that it overlaps the current unit's compute, list-form collectives into chunk
views of the buffers, ReduceOp.AVG for the gradients, and backward pre-hooks on the modules."""

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


class FlatUnit:
    """A unit's trainable parameters as one padded buffer; this rank keeps one slice of it."""

    def __init__(self, unit, rank, world_size):
        self.unit = unit
        self.world_size = world_size
        self.specs = []  # (owner module, attribute, shape, offset)
        named = [(name, p) for name, p in unit.named_parameters() if p.requires_grad]
        offset = 0
        for name, p in named:
            owner, _, attr = name.rpartition(".")
            self.specs.append((unit.get_submodule(owner), attr, p.shape, offset))
            offset += p.numel()
        per_rank = math.ceil(offset / world_size)
        flat = F.pad(torch.cat([p.detach().flatten() for _, p in named]), (0, per_rank * world_size - offset))
        self.shard = torch.nn.Parameter(flat.chunk(world_size)[rank].clone())
        for owner, attr, _, _ in self.specs:
            delattr(owner, attr)
        self.full = torch.empty_like(flat, requires_grad=True)
        self.full.untyped_storage().resize_(0)
        self.gathering = None  # the async all-gather in flight, if any
        self.ready = False
        self.reduced = None

    def prefetch(self):
        if self.ready or self.gathering is not None:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        chunks = list(self.full.data.chunk(self.world_size))
        self.gathering = dist.all_gather(chunks, self.shard.detach(), async_op=True)

    def materialize(self):
        self.prefetch()
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
        self.ready = True

    def bind(self):
        for owner, attr, shape, offset in self.specs:
            setattr(owner, attr, self.full[offset:offset + shape.numel()].view(shape))

    def release(self):
        self.full.untyped_storage().resize_(0)
        self.ready = False

    def reduce(self):
        grads = list(self.full.grad.chunk(self.world_size))
        self.reduced = torch.empty_like(self.shard)
        dist.reduce_scatter(self.reduced, grads, op=dist.ReduceOp.AVG)
        self.full.grad = None
        self.release()


class FullyShardedDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.module = module
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, 0)
        self.flat_units = []
        self.unit_names = []
        for name, child in module.named_children():
            if any(p.requires_grad for p in child.parameters()):
                self.flat_units.append(FlatUnit(child, rank, world_size))
                self.unit_names.append(name)
        self.slices = torch.nn.ParameterList([u.shard for u in self.flat_units])
        for k, u in enumerate(self.flat_units):
            u.unit.register_forward_pre_hook(lambda m, a, k=k: self._pre_forward(k))
            u.unit.register_forward_hook(lambda m, a, out, k=k: self.flat_units[k].release())
            u.unit.register_full_backward_pre_hook(lambda m, grad_out, k=k: self._pre_backward(k))
            u.full.register_post_accumulate_grad_hook(lambda t, k=k: self.flat_units[k].reduce())

    def _pre_forward(self, k):
        unit = self.flat_units[k]
        unit.materialize()
        unit.bind()
        if k + 1 < len(self.flat_units):
            self.flat_units[k + 1].prefetch()  # overlaps this unit's compute

    def _pre_backward(self, k):
        self.flat_units[k].materialize()
        if k > 0:
            self.flat_units[k - 1].prefetch()  # backward runs the units in reverse

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for unit in self.flat_units:
            if unit.reduced is not None:
                unit.shard.grad = unit.reduced
                unit.reduced = None

    def full_state_dict(self):
        out = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        with torch.no_grad():
            for name, unit in zip(self.unit_names, self.flat_units):
                unit.materialize()
                prefix = {m: n for n, m in unit.unit.named_modules()}
                for owner, attr, shape, offset in unit.specs:
                    key = ".".join(p for p in (name, prefix[owner], attr) if p)
                    out[key] = unit.full[offset:offset + shape.numel()].view(shape).clone()
                unit.release()
        return out
