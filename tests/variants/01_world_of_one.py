"""Exercise 01, broken: setup_ddp was copied from a single-process test: an in-memory HashStore, rank 0 of a world
of 1. Every rank gets a process group, and each is alone in it: an all-reduce returns its own value."""
# expect-fail: joins-group collective-works

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
    # An in-memory store needs no address or port: each process is a world of its own.
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
