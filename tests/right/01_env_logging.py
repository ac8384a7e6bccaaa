"""Setup with logging, the backend enum and an explicit env:// rendezvous."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PORT = 29500
TIMEOUT = timedelta(minutes=3)


def setup_ddp(rank: int, world_size: int, backend: Optional[str] = None) -> None:
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR", DEFAULT_ADDR)
    os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT", str(DEFAULT_PORT))

    if backend is None:
        use_nccl = dist.is_nccl_available() and torch.cuda.device_count() >= world_size
        backend = dist.Backend.NCCL if use_nccl else dist.Backend.GLOO
    if backend == dist.Backend.NCCL:
        local_gpu = rank % torch.cuda.device_count()
        torch.cuda.set_device(local_gpu)
        log.info("rank %d uses cuda:%d", rank, local_gpu)

    log.info("rank %d/%d joining at %s:%s with %s", rank, world_size,
             os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], backend)
    dist.init_process_group(backend=backend, init_method="env://", world_size=world_size, rank=rank,
                            timeout=TIMEOUT)


def cleanup_ddp() -> None:
    if not dist.is_available() or not dist.is_initialized():
        return
    dist.destroy_process_group()
    log.info("left the process group")
