"""Exercise 07, broken: every rank sends its whole tensor to every other rank."""
# expect-fail: ring-bytes ring-neighbours

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    original = tensor.clone()
    requests = [dist.isend(original, peer) for peer in range(world_size) if peer != rank]
    incoming = torch.empty_like(tensor)
    for peer in range(world_size):
        if peer != rank:
            dist.recv(incoming, peer)
            tensor.add_(incoming)
    for request in requests:
        request.wait()
