"""Process-group setup in the style of the PyTorch DDP tutorial (localhost, a helper per step)."""

import os
import datetime

import torch
from torch.distributed import destroy_process_group, init_process_group, is_initialized


def _pick_backend(world_size):
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    """
    Args:
        rank: Unique identifier of each process
        world_size: Total number of processes
    """
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = "localhost"
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = "29500"
    backend = backend or _pick_backend(world_size)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    init_process_group(backend=backend, rank=rank, world_size=world_size,
                       timeout=datetime.timedelta(seconds=120))


def cleanup_ddp() -> None:
    if is_initialized():
        destroy_process_group()
