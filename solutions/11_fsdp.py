"""Exercise 11: shard the parameters too (fully sharded data parallel, ZeRO stage 3).

ZeRO stage 1 (exercise 10) split the optimizer state, but every rank still
keeps every parameter and every gradient. Fully sharded data parallel splits
those as well: between steps each rank holds only a 1/world_size slice of
the parameters. A layer's full parameters exist only while that layer
computes: gathered from every rank's slice just before it runs, freed right
after, and gathered once more in backward when its gradients are computed.
The gradients leave backward the same way: each rank receives only the
average of its own slice (a reduce-scatter, half the traffic of an all-reduce).

The grader starts the processes (with RANK, LOCAL_RANK and WORLD_SIZE set, as
torchrun sets them) and the process group (gloo on CPU), and trains with your
class, in float32 and in float64:

    model = FullyShardedDP(net)        # net's direct children are the units
    optimizer = torch.optim.AdamW(model.parameters(), ...)   # or SGD
    for each step:
        loss = mse_loss(model(x), y)
        loss.backward()
        model.finish_gradient_synchronization()
        optimizer.step(); optimizer.zero_grad()
    model.full_state_dict()

    class FullyShardedDP(torch.nn.Module)
        __init__(self, module)
            - Every rank starts from rank 0's parameters and buffers (the
              ranks' modules are built differently on purpose).
            - A unit is a direct child of `module` (module.children()); every
              parameter of `module` lives in one. Each unit runs once per
              forward, takes one tensor and returns one tensor.
            - For each unit, flatten its parameters that require grad (nested
              ones too, as unit.named_parameters() lists them; they share one
              dtype) into one buffer, pad it with zeros to the next multiple of
              the world size, and keep this rank's slice of it (rank r keeps
              elements [r * n, (r + 1) * n), n = padded size / world size) as
              an nn.Parameter of this module: self.parameters() yields these
              slices, and they are what the optimizer steps.
            - Take the unit's original trainable parameters away (delattr),
              so that no full copy survives; while the unit runs, point those
              attribute names at views of the gathered buffer.
            - A parameter with requires_grad=False stays as it is, whole on
              every rank, like a buffer: after the broadcast from rank 0 it
              is neither trained nor communicated.
        forward(self, *args, **kwargs)
            Run the wrapped module. Just before a unit runs, all-gather its
            buffer from the slices (one all-gather per unit); just after, free
            it. In backward, gather it again before that unit's gradients are
            computed, and free it once they are. No more than two units'
            full parameters may be in memory at any moment.
        finish_gradient_synchronization(self)
            Called after loss.backward(): leave in every slice's .grad the
            average over the ranks of the gradient of that slice. One
            reduce-scatter per unit (never an all-reduce: no rank needs the
            other slices' gradients).
        full_state_dict(self) -> dict[str, torch.Tensor]
            The unsharded state with the keys and shapes of the original
            module's state_dict() (frozen parameters and buffers included),
            on every rank.

Freeing means that the memory goes away, not only a name. Autograd keeps a
reference to every tensor it saves for backward (a Linear saves its weight),
so dropping your own reference frees nothing before backward has run. Free a
buffer where it stands with `buf.untyped_storage().resize_(0)`; before filling
it again, `resize_(buf.numel() * buf.element_size())`: every view of it, those
autograd saved included, then sees the new values. Fill it through `buf.data`
(the same memory, without autograd's version counter), or autograd refuses the
views it saved: "modified by an inplace operation".

The grader counts the collectives of each step (all-gathers of a unit's padded
size, reduce-scatters of a slice's size), measures what each rank holds
between steps, and looks for full parameters in memory while each unit runs.
`dist.all_gather_single` and `dist.reduce_scatter_single` are torch 2.13's
names for all_gather_into_tensor and reduce_scatter_tensor; either works.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/11_fsdp.py      (stuck? ddp-grade hint 11)
"""

import math

import torch
import torch.distributed as dist


class FullyShardedDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

        # 1. Every rank starts from rank 0's model.
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

        # 2. Per unit: this rank's slice of the flat, padded parameters, and an empty full buffer.
        self.shards = torch.nn.ParameterList()
        self.full = []     # per unit: the gathered buffer; its .grad collects the unit's full gradient
        self.layout = []   # per unit: (name in the unit, shape, offset in the buffer) of each parameter
        self.units = []    # per unit: (name in module, the unit)
        for unit_name, unit in module.named_children():
            trainable = [(name, p) for name, p in unit.named_parameters() if p.requires_grad]
            if not trainable:
                continue
            numel = sum(p.numel() for _, p in trainable)
            slice_size = math.ceil(numel / self.world_size)
            flat = torch.cat([p.detach().reshape(-1) for _, p in trainable])
            flat = torch.nn.functional.pad(flat, (0, slice_size * self.world_size - numel))
            self.shards.append(torch.nn.Parameter(flat[self.rank * slice_size:(self.rank + 1) * slice_size].clone()))

            full = torch.empty_like(flat, requires_grad=True)
            full.untyped_storage().resize_(0)  # no memory until the unit runs
            self.full.append(full)

            layout, offset = [], 0
            for name, p in trainable:
                owner, _, attr = name.rpartition(".")
                delattr(unit.get_submodule(owner), attr)  # the full original goes away
                layout.append((name, p.shape, offset))
                offset += p.numel()
            self.layout.append(layout)
            self.units.append((unit_name, unit))

        # 3. Hooks: gather before each unit runs, free after; gather again in backward, and
        #    reduce-scatter the gradient once the unit's full gradient is complete.
        self.pending = []  # (work, slice, reduced gradient, full gradient) of reduce-scatters in flight
        for index, (_, unit) in enumerate(self.units):
            unit.register_forward_pre_hook(lambda unit, args, i=index: self._before_forward(i))
            unit.register_forward_hook(lambda unit, args, output, i=index: self._after_forward(i, output))
            self.full[index].register_post_accumulate_grad_hook(lambda full, i=index: self._after_backward(i))

    def _gather(self, i):
        full = self.full[i]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        # .data: the same memory, unseen by autograd (its saved views must not count as modified).
        dist.all_gather_single(full.data, self.shards[i].detach())

    def _free(self, i):
        self.full[i].untyped_storage().resize_(0)

    def _before_forward(self, i):
        self._gather(i)
        _, unit = self.units[i]
        full = self.full[i]
        for name, shape, offset in self.layout[i]:
            owner, _, attr = name.rpartition(".")
            view = full[offset:offset + shape.numel()].view(shape)  # a view: its gradient flows into full.grad
            setattr(unit.get_submodule(owner), attr, view)

    def _after_forward(self, i, output):
        self._free(i)
        if output.requires_grad:
            # Runs when the gradient of the unit's output is ready: just before the unit's own backward.
            output.register_hook(lambda grad: self._gather(i))

    def _after_backward(self, i):
        full = self.full[i]
        reduced = torch.empty_like(self.shards[i])
        work = dist.reduce_scatter_single(reduced, full.grad, async_op=True)
        # The pending list keeps the full gradient alive until the reduce-scatter is done with it.
        self.pending.append((work, self.shards[i], reduced, full.grad))
        full.grad = None
        self._free(i)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for work, shard, reduced, _ in self.pending:
            work.wait()
            shard.grad = reduced / self.world_size  # the reduce-scatter summed over the ranks
        self.pending = []

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        # Frozen parameters and buffers are still registered in the module, under their own keys.
        state = {key: value.clone() for key, value in self.module.state_dict().items()}
        with torch.no_grad():
            for i, (unit_name, _) in enumerate(self.units):
                self._gather(i)
                for name, shape, offset in self.layout[i]:
                    state[f"{unit_name}.{name}"] = self.full[i][offset:offset + shape.numel()].view(shape).clone()
                self._free(i)
        return state
