"""Exercise 07, wrong on purpose: a dist.monitored_barrier() between the reduce-scatter and the all-gather, to
keep the ranks in step: a collective, where the statement allows none (on gloo it is made of point-to-point
messages inside the process group, which no send or recv of the learner's shows)."""
# expect-fail: no-collectives
# expect-pass: matches-all-reduce ring-neighbours ring-bytes

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

    # Every rank done reducing before any starts gathering (and a rank that fell behind is named).
    dist.monitored_barrier()

    # All-gather: pass the summed chunks around the ring, overwriting partial ones.
    for step in range(world_size - 1):
        send_chunk = chunks[(rank + 1 - step) % world_size]
        recv_chunk = chunks[(rank - step) % world_size]
        request = dist.isend(send_chunk, send_to)
        dist.recv(recv_chunk, recv_from)
        request.wait()
