"""The ring with dist.P2POp and dist.batch_isend_irecv, one batch per step, on a flat view."""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor) -> None:
    world_size = dist.get_world_size()
    if world_size < 2:
        return
    rank = dist.get_rank()
    right, left = (rank + 1) % world_size, (rank - 1 + world_size) % world_size
    flat = tensor.view(-1)
    bounds = [flat.numel() * i // world_size for i in range(world_size + 1)]
    chunk = [flat[bounds[i]:bounds[i + 1]] for i in range(world_size)]

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    for step in range(world_size - 1):  # reduce-scatter
        s, r = (rank - step) % world_size, (rank - step - 1) % world_size
        incoming = torch.empty_like(chunk[r])
        exchange(chunk[s], incoming)
        chunk[r] += incoming
    for step in range(world_size - 1):  # all-gather
        s, r = (rank + 1 - step) % world_size, (rank - step) % world_size
        incoming = torch.empty_like(chunk[r])
        exchange(chunk[s], incoming)
        chunk[r].copy_(incoming)
