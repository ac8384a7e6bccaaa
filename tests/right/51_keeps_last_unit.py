"""Exercise 51, right, in another shape: FSDP2's reshard_after_forward=False for the last unit (it stays whole
from its forward to its backward, so backward needs no all-gather of it), the list forms of the collectives
(all_gather into per-rank chunks copied into the unit's buffer, reduce_scatter from a list of chunks), and the
bookkeeping in flat lists indexed by unit."""

import math

import torch
import torch.distributed as dist


class PrefetchingFSDP(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.W = dist.get_world_size()
        me = dist.get_rank()
        for t in [*module.parameters(), *module.buffers()]:
            with torch.no_grad():
                dist.broadcast(t, src=0)
        self.children_ = [c for c in module.children() if any(p.requires_grad for p in c.parameters())]
        self.prefix = {id(c): n for n, c in module.named_children()}
        self.params, self.flat, self.chunks, self.works, self.rs = [], [], [], [], []
        shards = []
        for c in self.children_:
            ps = [(n, p) for n, p in c.named_parameters() if p.requires_grad]
            total = sum(p.numel() for _, p in ps)
            each = math.ceil(total / self.W)
            flat = torch.zeros(each * self.W, dtype=ps[0][1].dtype)
            at = 0
            for _, p in ps:
                flat[at:at + p.numel()] = p.detach().reshape(-1)
                at += p.numel()
            shards.append(torch.nn.Parameter(flat[me * each:(me + 1) * each].clone()))
            buffer = torch.empty_like(flat).requires_grad_(True)
            buffer.untyped_storage().resize_(0)
            self.flat.append(buffer)
            self.params.append([(n, p.shape, p.numel()) for n, p in ps])
            self.chunks.append(None)
            self.works.append(None)
            for n, _ in ps:
                owner, _, leaf = n.rpartition(".")
                delattr(c.get_submodule(owner), leaf)
        self.shards = torch.nn.ParameterList(shards)
        last = len(self.children_) - 1
        for k, c in enumerate(self.children_):
            c.register_forward_pre_hook(lambda m, a, k=k: self.pre(k))
            c.register_forward_hook(lambda m, a, out, k=k, last=last: self.post(k, out, keep=k == last))
            self.flat[k].register_post_accumulate_grad_hook(lambda t, k=k: self.reduce(k))

    def issue(self, k):
        if k < 0 or k >= len(self.children_) or self.works[k] is not None:
            return
        if self.flat[k].untyped_storage().size() > 0:
            return  # still whole (the last unit, kept after its forward)
        self.chunks[k] = [torch.empty_like(self.shards[k]) for _ in range(self.W)]
        self.works[k] = dist.all_gather(self.chunks[k], self.shards[k].detach(), async_op=True)

    def ready(self, k):
        self.issue(k)
        if self.works[k] is None:
            return
        self.works[k].wait()
        self.works[k] = None
        buffer = self.flat[k]
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        torch.cat(self.chunks[k], out=buffer.data)
        self.chunks[k] = None

    def pre(self, k):
        self.ready(k)
        self.issue(k + 1)
        at = 0
        for n, shape, numel in self.params[k]:
            owner, _, leaf = n.rpartition(".")
            setattr(self.children_[k].get_submodule(owner), leaf, self.flat[k][at:at + numel].view(shape))
            at += numel

    def post(self, k, out, keep):
        if not keep:
            self.flat[k].untyped_storage().resize_(0)
        if out.requires_grad:
            out.register_hook(lambda g: self.pre_backward(k))

    def pre_backward(self, k):
        self.ready(k)
        self.issue(k - 1)

    def reduce(self, k):
        grad = self.flat[k].grad
        out = torch.empty_like(self.shards[k])
        work = dist.reduce_scatter(out, list(grad.chunk(self.W)), async_op=True)
        self.rs.append((k, work, out, grad))
        self.flat[k].grad = None
        self.flat[k].untyped_storage().resize_(0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for k, work, out, _ in self.rs:
            work.wait()
            self.shards[k].grad = out / self.W
        self.rs.clear()

    def full_state_dict(self):
        state = {k: v.clone() for k, v in self.module.state_dict().items()}
        with torch.no_grad():
            for k, c in enumerate(self.children_):
                self.ready(k)
                at = 0
                for n, shape, numel in self.params[k]:
                    state[f"{self.prefix[id(c)]}.{n}"] = self.flat[k][at:at + numel].view(shape).clone()
                    at += numel
                self.flat[k].untyped_storage().resize_(0)
        return state
