"""Every rank joins, then spins in the learner's own loop for ever."""
# expect-status: timeout
# expect-problem: still running your code: an endless loop?
# expect-problem: 01_loop_after_join.py line 2
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
    step = 0
    while step >= 0:  # the exit condition can never be met
        step += 1


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
