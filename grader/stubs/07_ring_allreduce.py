"""Exercise 07: the ring all-reduce, from point-to-point messages.

dist.all_reduce hides an algorithm. Write the one NCCL and gloo use for large
tensors: the ranks stand in a ring, each sends only to the next rank and
receives only from the previous one, and each moves about 2 * (W - 1) / W of
the tensor however many ranks there are.

    ring_all_reduce(tensor) -> None
        Sum `tensor` (contiguous, any shape, float32, float64 or int64) in place
        across the default process group, using only dist.send / dist.recv /
        dist.isend / dist.irecv (no collective calls):
        - split the flattened tensor into world_size chunks (sizes may differ;
          some are empty when the tensor has fewer elements than ranks);
        - reduce-scatter: world_size - 1 steps; at each step send one chunk to
          rank + 1, receive one from rank - 1 and add it into your copy, so that
          at the end each rank holds the full sum of one chunk;
        - all-gather: world_size - 1 more steps passing the finished chunks
          around the ring, until every rank has every summed chunk.
        World size 1 leaves the tensor unchanged.

The process group is already initialized by the grader (gloo on CPU), and
RANK, LOCAL_RANK and WORLD_SIZE are set, as under torchrun.
With gloo a blocking dist.send waits until the receiver has posted its receive,
at any size: if every rank sends first, nobody receives.

Replace the `raise NotImplementedError` below; keep the name and signature.
Grade it with:  ddp-grade exercises/07_ring_allreduce.py      (stuck? ddp-grade hint 07)
"""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    # TODO: split tensor.view(-1) into world_size chunks, then run world_size - 1
    # reduce-scatter steps and world_size - 1 all-gather steps, each sending one
    # chunk to rank + 1 and receiving one from rank - 1 (without deadlocking).
    raise NotImplementedError
