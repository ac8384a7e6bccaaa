"""One rank's flat parameter buffers under ZeRO 0-3, by hand (runs in a rank; used by :mod:`.capacity_run`).

A ``FlatBuffer`` holds a chunk's dense parameters (sharded over the data and context ranks) or its experts'
(over the ranks that hold the same experts): the parameters that compute as views of one flat tensor, the
gradients, the fp32 master copy under bf16-mixed and Adam's state, each whole or a shard of the buffer
padded to a multiple of the group's size. ZeRO 2 reduce-scatters after each backward of its chunk (the
whole gradient lives only until then), ZeRO 3 also gathers the parameters before each forward and backward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

LR, BETAS, EPS = 1e-3, (0.9, 0.999), 1e-8


class FlatBuffer:
    def __init__(self, named: list, dtype, zero: int, group, divide_by: int, shared: set[str] = frozenset()):
        self.dtype, self.mixed, self.zero, self.group = dtype, dtype != torch.float32, zero, group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.index = dist.get_rank(group) if group is not None else 0
        self.divide_by = divide_by
        self.layout, offset = [], 0  # (name, offset, shape)
        for name, value in named:
            self.layout.append((name, offset, tuple(value.shape)))
            offset += value.numel()
        self.count = offset
        self.shared = [(o, math.prod(s)) for name, o, s in self.layout if name in shared]
        self.shard = -(-self.count // self.size)
        self.padded = self.shard * self.size
        init = torch.cat([value.reshape(-1) for _, value in named])  # float32, count
        padded_init = torch.cat([init, init.new_zeros(self.padded - self.count)])
        mine = slice(self.index * self.shard, (self.index + 1) * self.shard)
        self.params = {name: torch.empty(0, dtype=dtype).requires_grad_() for name, _ in named}
        self.grad_flat = self.grad_shard = self.grad_full = self.shard_param = None
        self.exp_avg = self.exp_avg_sq = None
        if zero < 3:  # whole parameters: views of one flat buffer of this rank's count elements
            self.flat = init.to(dtype)
            self._bind_data(self.flat)
        else:  # only the shard stays; the whole buffer (padded) is gathered for forward and backward
            self.shard_param = padded_init[mine].to(dtype).clone()
            self.flat = torch.empty(self.padded, dtype=dtype)
            self._bind_data(self.flat)
            self.flat.untyped_storage().resize_(0)
        if self.mixed:  # the float32 master copy: whole under ZeRO-0, this rank's shard otherwise
            self.master = init.clone() if zero == 0 else padded_init[mine].clone()
        else:
            self.master = None

    # --- views --------------------------------------------------------------------------------------

    def _bind_data(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for name, offset, shape in self.layout:
                self.params[name].data = flat[offset:offset + math.prod(shape)].view(shape)

    def _bind_grads(self, flat: torch.Tensor | None) -> None:
        for name, offset, shape in self.layout:
            self.params[name].grad = None if flat is None else flat[offset:offset + math.prod(shape)].view(shape)

    def storages(self) -> set:
        return {p.untyped_storage().data_ptr() for p in self.params.values()} | {self.flat.untyped_storage().data_ptr()}

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """The whole buffer of a reduce-scatter: ``flat`` (count elements) padded to size x shard."""
        if flat.numel() == self.padded:
            return flat
        return torch.cat([flat, flat.new_zeros(self.padded - flat.numel())])

    def _mine(self, flat: torch.Tensor) -> torch.Tensor:
        """A shard-sized copy of this rank's part of ``flat``, zero past its end."""
        return self._padded(flat)[self.index * self.shard:(self.index + 1) * self.shard].clone()

    def _reduce_scatter(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the sum over the group of ``whole`` (padded), averaged over the data ranks."""
        out = torch.empty(self.shard, dtype=whole.dtype)
        if self.size > 1:
            dist.reduce_scatter_single(out, whole, group=self.group)
        else:
            out.copy_(whole[:self.shard])
        return out.div_(self.divide_by)

    def _all_gather(self, shard: torch.Tensor, out: torch.Tensor) -> None:
        if self.size > 1:
            dist.all_gather_single(out, shard, group=self.group)
        else:
            out.copy_(shard)

    def reduce_shared(self, grads: torch.Tensor, tp_group) -> None:
        """Sum over the tensor-parallel ranks the gradients of what each computed on its own tokens (sequence
        parallelism: norms, row-parallel biases), in one all-reduce."""
        if not self.shared or tp_group is None:
            return
        parts = torch.cat([grads[o:o + n] for o, n in self.shared])
        dist.all_reduce(parts, group=tp_group)
        start = 0
        for o, n in self.shared:
            grads[o:o + n].copy_(parts[start:start + n])
            start += n

    # --- a step ---------------------------------------------------------------------------------------

    def start_step(self) -> None:
        if self.zero < 2:
            if self.grad_flat is None:
                self.grad_flat = torch.zeros(self.count, dtype=self.dtype)
            self.grad_flat.zero_()
            self._bind_grads(self.grad_flat)
        else:
            self.grad_shard = torch.zeros(self.shard, dtype=self.dtype)

    def before_forward(self) -> None:
        if self.zero == 3:
            self._gather_parameters()

    def after_forward(self) -> None:
        if self.zero == 3:
            self.flat.untyped_storage().resize_(0)

    def before_backward(self) -> None:
        if self.zero == 3:
            self._gather_parameters()
            self.grad_full = torch.zeros(self.padded, dtype=self.dtype)
            self._bind_grads(self.grad_full)
        elif self.zero == 2:  # this micro-batch's whole gradient, until its reduce-scatter
            self.grad_full = torch.zeros(self.count, dtype=self.dtype)
            self._bind_grads(self.grad_full)

    def after_backward(self, tp_group) -> None:
        if self.zero >= 2:  # sharded gradients: reduce this micro-batch's now, keep the shard only
            self.reduce_shared(self.grad_full, tp_group)
            self.grad_shard.add_(self._reduce_scatter(self._padded(self.grad_full)))
            self._bind_grads(None)
            self.grad_full = None
        if self.zero == 3:
            self.flat.untyped_storage().resize_(0)

    def _gather_parameters(self) -> None:
        self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        self._all_gather(self.shard_param, self.flat)

    def reduce(self, tp_group) -> None:
        """ZeRO-0: one all-reduce of the whole flat gradient; ZeRO-1: one reduce-scatter, the shard written back
        into the whole gradient's own place (ZeRO-2/3 reduced per micro-batch)."""
        if self.zero >= 2:
            return
        self.reduce_shared(self.grad_flat, tp_group)
        if self.zero == 0:
            if self.size > 1:
                dist.all_reduce(self.grad_flat, group=self.group)
            self.grad_flat.div_(self.divide_by)
        else:
            reduced = self._reduce_scatter(self._padded(self.grad_flat))
            start = self.index * self.shard
            end = min(self.count, start + self.shard)
            if end > start:
                self.grad_flat[start:end].copy_(reduced[:end - start])

    def update(self, step: int) -> None:
        """Adam on the whole flat buffer (ZeRO-0) or this rank's shard, then the parameters that compute."""
        if self.zero == 0:
            grad = self.grad_flat.float()
            target = self.master if self.mixed else self.flat
        elif self.zero in (1, 2):  # the shard of the whole parameters, updated and gathered back
            grad = (self._mine(self.grad_flat) if self.zero == 1 else self.grad_shard).float()
            target = self.master if self.mixed else self._mine(self.flat)
        else:
            grad = self.grad_shard.float()
            target = self.master if self.mixed else self.shard_param
        if self.exp_avg is None:
            self.exp_avg, self.exp_avg_sq = torch.zeros_like(target), torch.zeros_like(target)
        adam(target, grad, self.exp_avg, self.exp_avg_sq, step=step)
        del grad
        with torch.no_grad():
            if self.zero == 0:
                if self.mixed:
                    self.flat.copy_(self.master)
            elif self.zero in (1, 2):
                whole = torch.empty(self.padded, dtype=self.dtype)
                self._all_gather(target.to(self.dtype), whole)
                self.flat.copy_(whole[:self.count])
            elif self.mixed:
                self.shard_param.copy_(self.master)

    def roots(self) -> dict:
        """What the buffer keeps, by kind, for the measurement."""
        return {"params": [self.flat, self.shard_param, list(self.params.values())],
                "grads": [self.grad_flat, self.grad_shard, self.grad_full] + [p.grad for p in self.params.values()],
                "optimizer": [self.master, self.exp_avg, self.exp_avg_sq]}


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int) -> None:
    """torch.optim.Adam's update, by hand (no torch.optim: it imports torch._dynamo)."""
    beta1, beta2 = BETAS
    with torch.no_grad():
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(EPS)
        param.addcdiv_(exp_avg, denom, value=-LR / (1 - beta1 ** step))
