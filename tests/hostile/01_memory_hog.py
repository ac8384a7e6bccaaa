"""Rank 1 fills memory step by step: stopped by the memory limit, named as such."""
# expect-status: failed
# expect-problem: rank 1 went over the memory limit
# grade-args: --timeout 30 --memory-limit 700

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
    hoard = []
    while rank == 1:
        hoard.append(bytearray(20 * 2**20))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
