"""Exercise 01, broken: rank 0 waits for a message that never comes."""
# expect-status: timeout
# expect-problem: rank 0
# grade-options: timeout_s=8

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    # A launcher (torchrun, the grader) may already have chosen where to meet.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")

    if backend is None:
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        backend = "nccl" if enough_gpus else "gloo"

    if backend == "nccl":
        # Without this every rank would talk through GPU 0.
        torch.cuda.set_device(rank % torch.cuda.device_count())

    # gloo waits 30 minutes by default before giving up on a peer: a deadlock
    # would look like a very slow job.
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=5))
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)  # rank 1 never sends: a deadlock


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
