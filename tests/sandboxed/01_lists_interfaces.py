"""Otherwise right, but refuses to run when it can see any network interface besides loopback."""

import os
from datetime import timedelta

import torch.distributed as dist


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    import socket
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:
        raise RuntimeError(f"saw network interfaces {names}")
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))
