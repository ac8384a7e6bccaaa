"""Prints 8 MB per rank and is otherwise right: passes, and only a bounded tail is kept."""
# expect-status: passed

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
    print(("x" * 99 + "\n") * 80_000, flush=True)


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
