"""Right answer for exercise 52 in another shape: a small class per step, the schedule as three phases of a
generator, each forward run with torch.func.functional_call on detached copies of the stage's parameters (so that
W is the gradient with respect to those copies, added to the stage's .grad by hand), the micro-batches waiting for
their W in a deque, the input's gradient through torch.autograd.backward(inputs=...).
"""

from collections import deque

import torch
import torch.distributed as dist
from torch.func import functional_call


def zb_h1(rank, size, m):
    """Yield ZB-H1's passes on one rank: warm-up, steady rounds, then the drain."""
    warm = min(size - rank - 1, m)
    for i in range(warm):
        yield "F", i
    waiting = deque()
    for step in range(m - warm):
        yield "F", warm + step
        yield "B", step
        waiting.append(step)
        if step >= rank:
            yield "W", waiting.popleft()
    for i in range(m - warm, m):
        yield "B", i
        waiting.append(i)
        yield "W", waiting.popleft()
    while waiting:
        yield "W", waiting.popleft()


class _Step:
    def __init__(self, stage, m, loss_fn):
        self.stage, self.m, self.loss_fn = stage, m, loss_fn
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        self.named = dict(stage.named_parameters())
        self.sample = next(iter(self.named.values()))
        self.pending = []
        self.state = {}
        self.losses = []
        self.in_shape = None

    def forward(self, i, chunk, tgt):
        if self.first:
            x = chunk
        else:
            if self.in_shape is None:
                header = torch.zeros(4, dtype=torch.int64)
                dist.recv(header, self.rank - 1)
                self.in_shape = tuple(int(v) for v in header[1:1 + int(header[0])])
            x = torch.zeros(self.in_shape, dtype=self.sample.dtype)
            dist.recv(x, self.rank - 1)
            x.requires_grad_(True)
        copies = {name: p.detach().requires_grad_(True) for name, p in self.named.items()}
        y = functional_call(self.stage, copies, (x,))
        if self.last:
            loss = self.loss_fn(y, tgt)
            self.losses.append(float(loss))
            y = loss / self.m
        else:
            if i == 0:
                header = torch.zeros(4, dtype=torch.int64)
                header[0] = y.dim()
                header[1:1 + y.dim()] = torch.tensor(y.shape)
                self.pending.append(dist.isend(header, self.rank + 1))
            self.pending.append(dist.isend(y.detach().clone(), self.rank + 1))
        self.state[i] = [x, y, copies, None]

    def backward_input(self, i):
        x, y, copies, _ = self.state[i]
        dy = None
        if not self.last:
            dy = torch.zeros_like(y)
            dist.recv(dy, self.rank + 1)
        self.state[i][3] = dy
        if not self.first:
            torch.autograd.backward(y, dy, inputs=[x], retain_graph=True)
            self.pending.append(dist.isend(x.grad, self.rank - 1))

    def backward_weight(self, i):
        x, y, copies, dy = self.state.pop(i)
        names = list(copies)
        grads = torch.autograd.grad(y, [copies[n] for n in names], dy)
        for name, grad in zip(names, grads):
            param = self.named[name]
            param.grad = grad if param.grad is None else param.grad + grad


def zero_bubble_step(stage, batch, target, num_microbatches, loss_fn):
    step = _Step(stage, num_microbatches, loss_fn)
    chunks = list(batch.chunk(num_microbatches)) if step.first else [None] * num_microbatches
    targets = list(target.chunk(num_microbatches)) if step.last else [None] * num_microbatches
    for kind, i in zb_h1(step.rank, step.size, num_microbatches):
        if kind == "F":
            step.forward(i, chunks[i], targets[i])
        elif kind == "B":
            step.backward_input(i)
        else:
            step.backward_weight(i)
    for request in step.pending:
        request.wait()
    return sum(step.losses) / num_microbatches if step.last else None
