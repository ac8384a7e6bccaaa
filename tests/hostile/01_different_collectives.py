"""Mismatched collectives: rank 0 calls all_reduce where rank 1 calls all_gather."""
# expect-status: timeout
# expect-problem: still running
# expect-problem: stuck in a collective that the other ranks do not call
# grade-args: --timeout 8

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=5))
    if rank == 0:
        dist.all_reduce(torch.zeros(4))
    else:
        dist.all_gather([torch.zeros(4) for _ in range(world_size)], torch.zeros(4))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
