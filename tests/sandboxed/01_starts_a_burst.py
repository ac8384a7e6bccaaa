"""Right, and one of its processes starts 5,000 threads at once, each waiting: it passes only if all of
them run together. The sandbox's task limit (RLIMIT_NPROC for a user, counted per user namespace; a pids
cgroup for root, whom RLIMIT_NPROC exempts) stops it at 4,096 tasks, and the file fails."""

import os
import threading
from datetime import timedelta

import torch.distributed as dist

BURST = 5_000


def burst() -> None:
    """Once per sandbox (the first process to get here), or raise why not."""
    try:
        os.close(os.open("/tmp/starts-a-burst", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    threading.stack_size(256 * 2**10)
    release = threading.Event()
    started = []
    try:
        for _ in range(BURST):
            thread = threading.Thread(target=release.wait, daemon=True)
            thread.start()
            started.append(thread)
    except RuntimeError as exc:
        raise RuntimeError(f"started {len(started)} threads of {BURST}: {exc}") from None
    finally:
        release.set()


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    burst()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
