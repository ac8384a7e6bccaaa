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

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/08_bucketed.py      (stuck? ddp-grade hint 08)
"""

import itertools

import torch
import torch.distributed as dist


class BucketedDDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float):
        super().__init__()
        self.module = module
        # TODO: broadcast parameters and buffers from rank 0; build self.buckets
        # (reverse registration order, cap in MiB); register a hook on each
        # bucketed parameter that starts its bucket's all-reduce when it is full.
        raise NotImplementedError

    def forward(self, *args, **kwargs):
        # TODO: call the wrapped module.
        raise NotImplementedError

    def finish_gradient_synchronization(self) -> None:
        # TODO: wait for every all-reduce started by the hooks, then put the
        # averaged gradients back into each parameter's .grad.
        raise NotImplementedError
