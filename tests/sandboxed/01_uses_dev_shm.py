"""Otherwise right, but reads a file the machine keeps in /dev/shm and leaves one of its own there (both
paths come from the test)."""

import os
from datetime import timedelta

import torch.distributed as dist


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    planted = os.environ.get("DDP_GRADE_TEST_SHM_READ", "")
    if planted and os.path.exists(planted):
        raise RuntimeError("read the machine's /dev/shm: " + open(planted).read())
    left = os.environ.get("DDP_GRADE_TEST_SHM_WRITE", "")
    if left:
        with open(left, "w") as f:
            f.write("left by a submission")
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
