"""Mismatched collectives: rank 0 calls all_reduce once more than rank 1.

Rank 0 is left waiting in an all_reduce that rank 1 never calls; when rank 1
ends, rank 0's wait fails instead of hanging.
"""
# expect-status: failed
# expect-problem: rank 0 raised RuntimeError
# expect-problem: by peer
# expect-problem: in all_reduce
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
        dist.all_reduce(torch.zeros(1))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
