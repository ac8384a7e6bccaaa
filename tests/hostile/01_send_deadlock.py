"""Both ranks send first and receive second: blocking sends wait for each other."""
# expect-status: timeout
# expect-problem: send
# expect-problem: stuck in blocking send/recv calls
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
    peer = (rank + 1) % world_size
    dist.send(torch.ones(1), dst=peer)
    dist.recv(torch.zeros(1), src=(rank - 1) % world_size)


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
