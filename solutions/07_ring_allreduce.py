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

Grade it with:  ddp-grade exercises/07_ring_allreduce.py
"""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    world_size = dist.get_world_size()
    if world_size == 1:
        return
    rank = dist.get_rank()
    send_to = (rank + 1) % world_size
    recv_from = (rank - 1) % world_size

    # Views into the tensor: writing into a chunk writes into the tensor, so the
    # sum ends up in place. tensor_split always gives world_size chunks.
    chunks = tensor.view(-1).tensor_split(world_size)
    incoming = torch.empty_like(chunks[0])  # the first chunk is the largest

    # Reduce-scatter: at step s, add the partial sum of chunk (rank - s - 1) from
    # the left. After world_size - 1 steps this rank holds chunk (rank + 1) summed.
    for step in range(world_size - 1):
        send_chunk = chunks[(rank - step) % world_size]
        recv_chunk = chunks[(rank - step - 1) % world_size]
        buffer = incoming[: recv_chunk.numel()]
        # isend returns at once: every rank sends before it receives, and a
        # blocking send would wait for a receive that its neighbour never reaches.
        request = dist.isend(send_chunk, send_to)
        dist.recv(buffer, recv_from)
        request.wait()
        recv_chunk.add_(buffer)

    # All-gather: pass the summed chunks around the ring, overwriting partial ones.
    for step in range(world_size - 1):
        send_chunk = chunks[(rank + 1 - step) % world_size]
        recv_chunk = chunks[(rank - step) % world_size]
        request = dist.isend(send_chunk, send_to)
        dist.recv(recv_chunk, recv_from)
        request.wait()
