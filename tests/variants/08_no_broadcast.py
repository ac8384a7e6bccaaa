"""Exercise 08, broken: no broadcast in __init__: each rank keeps its own initial model."""
# expect-fail: broadcast-from-rank0 params-identical grads-match-ddp
# expect-cause: grads-match-ddp broadcast-from-rank0
# expect-cause: params-identical broadcast-from-rank0

import itertools

import torch
import torch.distributed as dist


class BucketedDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()

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

        # 3. A hook per parameter counts down its bucket's missing gradients.
        self._bucket_index = {}
        for index, bucket in enumerate(self.buckets):
            for param in bucket:
                self._bucket_index[param] = index
                param.register_post_accumulate_grad_hook(self._gradient_ready)
        self._missing = [len(bucket) for bucket in self.buckets]
        self._pending = []  # (work, flat gradients, bucket) of all-reduces in flight

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _gradient_ready(self, param: torch.Tensor) -> None:
        index = self._bucket_index[param]
        self._missing[index] -= 1
        if self._missing[index] > 0:
            return
        bucket = self.buckets[index]
        # One flat tensor per bucket: one message instead of one per parameter.
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        work = dist.all_reduce(flat, async_op=True)  # returns at once; backward goes on
        self._pending.append((work, flat, bucket))

    def finish_gradient_synchronization(self) -> None:
        for work, flat, bucket in self._pending:
            work.wait()
            flat.div_(self.world_size)
            for param, averaged in zip(bucket, flat.split([p.numel() for p in bucket])):
                param.grad.copy_(averaged.view_as(param))
        self._pending.clear()
        self._missing = [len(bucket) for bucket in self.buckets]
