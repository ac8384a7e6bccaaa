"""Otherwise right, but writes 3,000 MB into /tmp (in files of 30 MB, under the output limit) before joining
the group."""

import os
from datetime import timedelta

import torch.distributed as dist


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if rank == 0:
        block = b"\0" * 2**20
        paths = [f"/tmp/fill-{os.getpid()}-{i}" for i in range(100)]
        try:
            for path in paths:
                with open(path, "wb") as f:
                    for _ in range(30):
                        f.write(block)
        finally:
            for path in paths:  # on the machine's own /tmp (no sandbox), leave nothing behind
                if os.path.exists(path):
                    os.unlink(path)
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
