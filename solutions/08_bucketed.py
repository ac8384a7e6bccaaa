"""Exercise 08: overlap communication with backward, the way DDP does.

Averaging gradients after backward() leaves the network idle while autograd
works, then autograd idle while the network works. DDP instead groups the
gradients into buckets and starts a bucket's all-reduce the moment its last
gradient is ready, while backward is still computing the earlier layers.

    class BucketedDDP(torch.nn.Module)
        __init__(self, module, bucket_cap_mb: float)
            - Broadcast every parameter and buffer from rank 0, so all ranks
              start from the same model (frozen parameters too).
            - Group the parameters that require grad into buckets, walking them
              in reverse registration order (gradients become ready roughly
              from the last layer to the first). The cap is in MiB (2**20 bytes):
              a bucket closes when adding the next parameter would pass the cap;
              a parameter that reaches the cap exactly still fits; a parameter
              larger than the cap gets a bucket of its own. A parameter's size is
              numel() * element_size(): models may be float64, or mix dtypes.
              Keep them as `self.buckets`, a list of lists of parameters, in the
              order their all-reduces will be issued.
            - Register a hook on each of those parameters (for instance
              `param.register_post_accumulate_grad_hook`) so that when the last
              gradient of a bucket is ready, that bucket's all-reduce starts
              with `dist.all_reduce(..., async_op=True)`: one all-reduce per
              bucket per step.
            Parameters without requires_grad are never bucketed or all-reduced.
        forward(self, *args, **kwargs)
            Call the wrapped module.
        finish_gradient_synchronization(self)
            Wait for every pending all-reduce and leave each parameter's .grad
            holding the average of that gradient over the ranks, as precise as
            the gradient's own dtype. Called after loss.backward() and before
            optimizer.step().

The process group is already initialized by the grader (gloo on CPU), and
RANK, LOCAL_RANK and WORLD_SIZE are set, as under torchrun.

Grade it with:  ddp-grade exercises/08_bucketed.py
"""

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
