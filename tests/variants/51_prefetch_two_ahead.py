"""Exercise 51, broken: two units are prefetched ahead, in forward and in backward, for more overlap: while unit i
computes, units i + 1 and i + 2 are whole in memory too, three units where two are allowed."""
# expect-fail: two-units-at-a-time
# expect-pass: matches-training prefetch-forward prefetch-backward
# expect-message: two-units-at-a-time at most two may be

import math

import torch
import torch.distributed as dist


class PrefetchingFSDP(torch.nn.Module):
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
        self.units = []    # per unit, in the order they run: (name in module, the unit)
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
            full.untyped_storage().resize_(0)  # no memory until the unit is gathered
            self.full.append(full)

            layout, offset = [], 0
            for name, p in trainable:
                owner, _, attr = name.rpartition(".")
                delattr(unit.get_submodule(owner), attr)  # the full original goes away
                layout.append((name, p.shape, offset))
                offset += p.numel()
            self.layout.append(layout)
            self.units.append((unit_name, unit))

        # 3. Hooks: before a unit runs, wait for its all-gather and prefetch the next one; free it after;
        #    the same in reverse in backward; reduce-scatter a unit's gradient as soon as it is complete.
        self.gathers = {}  # unit index -> the all-gather in flight (issued, not yet waited for)
        self.pending = []  # (work, slice, reduced gradient, full gradient) of reduce-scatters in flight
        for index, (_, unit) in enumerate(self.units):
            unit.register_forward_pre_hook(lambda unit, args, i=index: self._before_forward(i))
            unit.register_forward_hook(lambda unit, args, output, i=index: self._after_forward(i, output))
            self.full[index].register_post_accumulate_grad_hook(lambda full, i=index: self._after_backward(i))

    def _issue_gather(self, i):
        if i in self.gathers or not 0 <= i < len(self.units):
            return
        full = self.full[i]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        # .data: the same memory, unseen by autograd (its saved views must not count as modified).
        self.gathers[i] = dist.all_gather_single(full.data, self.shards[i].detach(), async_op=True)

    def _wait_gather(self, i):
        self._issue_gather(i)  # the first unit of a pass: nothing prefetched it
        self.gathers.pop(i).wait()

    def _free(self, i):
        self.full[i].untyped_storage().resize_(0)

    def _before_forward(self, i):
        self._wait_gather(i)
        self._issue_gather(i + 1)  # travels while unit i computes
        self._issue_gather(i + 2)
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
            output.register_hook(lambda grad: self._before_backward(i))

    def _before_backward(self, i):
        self._wait_gather(i)
        self._issue_gather(i - 1)  # travels while unit i's backward computes
        self._issue_gather(i - 2)

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
                self._wait_gather(i)
                for name, shape, offset in self.layout[i]:
                    state[f"{unit_name}.{name}"] = self.full[i][offset:offset + shape.numel()].view(shape).clone()
                self._free(i)
        return state
