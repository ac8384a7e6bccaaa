"""BucketedDDP from tensor hooks (param.register_hook, which sees each gradient before it is
accumulated into .grad), the way older tutorials write it; buckets kept by index."""

import torch
import torch.distributed as dist


class BucketedDDP(torch.nn.Module):
    def __init__(self, module, bucket_cap_mb):
        super().__init__()
        self.module = module
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, 0)  # state_dict() tensors share storage with the module's

        limit = bucket_cap_mb * 2 ** 20
        self.buckets, current, current_bytes = [], [], 0
        for p in reversed(list(module.parameters())):
            if not p.requires_grad:
                continue
            nbytes = p.nelement() * p.element_size()
            if current and current_bytes + nbytes > limit:
                self.buckets.append(current)
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += nbytes
        if current:
            self.buckets.append(current)

        self._grads = [dict() for _ in self.buckets]
        self._handles = []
        for index, bucket in enumerate(self.buckets):
            for position, p in enumerate(bucket):
                p.register_hook(self._make_hook(index, position))

    def _make_hook(self, index, position):
        def hook(grad):
            self._grads[index][position] = grad.detach().reshape(-1)
            if len(self._grads[index]) == len(self.buckets[index]):
                flat = torch.cat([self._grads[index][i] for i in range(len(self.buckets[index]))])
                self._handles.append((index, flat, dist.all_reduce(flat, async_op=True)))
            return grad
        return hook

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        world = dist.get_world_size()
        for index, flat, handle in self._handles:
            handle.wait()
            averaged = (flat / world).split([p.numel() for p in self.buckets[index]])
            for p, g in zip(self.buckets[index], averaged):
                p.grad.copy_(g.view_as(p))
        self._handles = []
        self._grads = [dict() for _ in self.buckets]
