"""Exercise 08, broken: no hooks: every bucket is all-reduced, blocking, after backward has finished."""
# expect-fail: async-overlap

import itertools

import torch
import torch.distributed as dist


class BucketedDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()

        # 1. Every rank starts from rank 0's model.
        with torch.no_grad():
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)

        # 2. Buckets, last layer first: its gradients are the first to be ready.
        cap_bytes = bucket_cap_mb * 2**20
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.buckets = []
        bucket, bucket_bytes = [], 0
        for param in reversed(trainable):
            param_bytes = param.numel() * param.element_size()
            if bucket and bucket_bytes + param_bytes > cap_bytes:
                self.buckets.append(bucket)
                bucket, bucket_bytes = [], 0
            bucket.append(param)
            bucket_bytes += param_bytes
        if bucket:
            self.buckets.append(bucket)


    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        for bucket in self.buckets:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat)
            flat.div_(self.world_size)
            for param, averaged in zip(bucket, flat.split([p.numel() for p in bucket])):
                param.grad.copy_(averaged.view_as(param))
