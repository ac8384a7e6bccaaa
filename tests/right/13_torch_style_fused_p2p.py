"""Right answer for exercise 13, shaped like torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B.

Ranks from the environment; every message goes through dist.batch_isend_irecv; 1F1B warms up with
W - r forwards and then fuses each send with the next receive, as torch does; the shape travels as
two small messages (its length, then the sizes) before the first activation.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed import P2POp, batch_isend_irecv


def _run(ops):
    """Start the operations together and wait for all of them."""
    if ops:
        for work in batch_isend_irecv(ops):
            work.wait()


def _fire(ops):
    return batch_isend_irecv(ops) if ops else []


def _wait(works):
    for work in works:
        work.wait()


class _Stage:
    def __init__(self, module, rank, world_size, num_microbatches, loss_fn):
        self.module, self.rank, self.world_size = module, rank, world_size
        self.first, self.last = rank == 0, rank == world_size - 1
        self.m, self.loss_fn = num_microbatches, loss_fn
        ref = next(module.parameters())
        self.dtype, self.device = ref.dtype, ref.device
        self.in_shape = None
        self.inputs, self.outputs, self.losses = {}, {}, []
        self.recv_buf, self.grad_buf = {}, {}

    # shape handshake, once per step
    def send_shape(self, out):
        dims = torch.tensor(list(out.shape), dtype=torch.int64, device=self.device)
        _run([P2POp(dist.isend, torch.tensor([dims.numel()], device=self.device), self.rank + 1)])
        _run([P2POp(dist.isend, dims, self.rank + 1)])

    def recv_shape(self):
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        _run([P2POp(dist.irecv, n, self.rank - 1)])
        dims = torch.zeros(int(n), dtype=torch.int64, device=self.device)
        _run([P2POp(dist.irecv, dims, self.rank - 1)])
        self.in_shape = torch.Size(dims.tolist())

    # the operations of one micro-batch
    def fwd_recv_ops(self, i):
        if self.first:
            return []
        if self.in_shape is None:
            self.recv_shape()
        self.recv_buf[i] = torch.empty(self.in_shape, dtype=self.dtype, device=self.device)
        return [P2POp(dist.irecv, self.recv_buf[i], self.rank - 1)]

    def fwd_send_ops(self, i):
        if self.last:
            return []
        return [P2POp(dist.isend, self.outputs[i].detach(), self.rank + 1)]

    def bwd_recv_ops(self, i):
        if self.last:
            return []
        self.grad_buf[i] = torch.empty_like(self.outputs[i])
        return [P2POp(dist.irecv, self.grad_buf[i], self.rank + 1)]

    def bwd_send_ops(self, i):
        if self.first:
            return []
        return [P2POp(dist.isend, self.inputs[i].grad, self.rank - 1)]

    def forward(self, i, data, targets):
        x = data[i] if self.first else self.recv_buf.pop(i).requires_grad_()
        out = self.module(x)
        self.inputs[i] = x
        if self.last:
            loss = self.loss_fn(out, targets[i])
            self.losses.append(loss.detach())
            out = loss / self.m
        elif i == 0:
            self.send_shape(out)
        self.outputs[i] = out

    def backward(self, i):
        out = self.outputs.pop(i)
        if self.last:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, grad_tensors=self.grad_buf.pop(i))


def pipeline_step(stage, batch, target, num_microbatches, loss_fn, schedule="gpipe"):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    s = _Stage(stage, rank, world_size, num_microbatches, loss_fn)
    data = torch.chunk(batch, num_microbatches) if s.first else None
    targets = torch.chunk(target, num_microbatches) if s.last else None
    sends = []

    if schedule == "gpipe":
        for i in range(num_microbatches):
            _run(s.fwd_recv_ops(i))
            s.forward(i, data, targets)
            sends += _fire(s.fwd_send_ops(i))
        _wait(sends)
        sends = []
        for i in range(num_microbatches):
            _run(s.bwd_recv_ops(i))
            s.backward(i)
            sends += _fire(s.bwd_send_ops(i))
        _wait(sends)
    elif schedule == "1f1b":
        warmup = min(num_microbatches, world_size - rank)
        fwd = bwd = 0
        pending, fwd_sends = [], []
        for _ in range(warmup):
            _run(s.fwd_recv_ops(fwd))
            s.forward(fwd, data, targets)
            _wait(pending)
            fwd_sends = s.fwd_send_ops(fwd)
            if fwd != warmup - 1:
                pending, fwd_sends = _fire(fwd_sends), []
            else:
                pending = []
            fwd += 1
        while True:
            _run(fwd_sends + s.bwd_recv_ops(bwd))
            s.backward(bwd)
            bwd_sends = s.bwd_send_ops(bwd)
            bwd += 1
            if fwd == num_microbatches:
                break
            _run(bwd_sends + s.fwd_recv_ops(fwd))
            s.forward(fwd, data, targets)
            fwd_sends = s.fwd_send_ops(fwd)
            fwd += 1
        while bwd < num_microbatches:
            _run(bwd_sends + s.bwd_recv_ops(bwd))
            s.backward(bwd)
            bwd_sends = s.bwd_send_ops(bwd)
            bwd += 1
        _run(bwd_sends)
    else:
        raise ValueError(f"unknown schedule {schedule!r}")

    if not s.last:
        return None
    return torch.stack(s.losses).mean().item()
