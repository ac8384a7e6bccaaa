"""Otherwise right, but looks for the kit's answers and history and for another learner's file (their
paths come from the test): in a sandbox it must find none of them."""

import os
from datetime import timedelta

import torch.distributed as dist


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    kit = os.environ.get("DDP_GRADE_TEST_KIT", "")
    wanted = [os.path.join(kit, "solutions", "01_setup.py"), os.path.join(kit, ".git", "HEAD"),
              os.path.join(kit, "tests", "conftest.py"), os.environ.get("DDP_GRADE_TEST_OTHER", "")]
    for path in wanted:
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                raise RuntimeError(f"can read {path}: {f.read(40)!r}")
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))
