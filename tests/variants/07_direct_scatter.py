"""Exercise 07, broken: right byte count, but each chunk goes straight to its owner, not around a ring."""
# expect-fail: ring-neighbours

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    if world_size == 1:
        return
    chunks = tensor.view(-1).tensor_split(world_size)
    mine = chunks[rank]

    # Reduce-scatter: send chunk j to rank j, add what the others send for my chunk.
    requests = [dist.isend(chunks[peer].clone(), peer) for peer in range(world_size) if peer != rank]
    incoming = torch.empty_like(mine)
    for peer in range(world_size):
        if peer != rank:
            dist.recv(incoming, peer)
            mine.add_(incoming)
    for request in requests:
        request.wait()

    # All-gather: send my summed chunk to everyone, receive theirs.
    requests = [dist.isend(mine, peer) for peer in range(world_size) if peer != rank]
    for peer in range(world_size):
        if peer != rank:
            dist.recv(chunks[peer], peer)
    for request in requests:
        request.wait()
