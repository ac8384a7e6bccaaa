"""Right, and one of its processes writes a file of 64 MiB more than the tmp limit into the ranks' folder,
which it unlinks first and holds open (no walk of the folder finds it). It passes only if it writes it
all: the folder is a tmpfs of the tmp limit's size, where an unlinked file counts, and the file fails
naming the tmp limit."""

import os
from datetime import timedelta

import torch.distributed as dist

CHUNK = b"\1" * 2**20
HELD: list = []


def unlink() -> None:
    """Once per sandbox (the first process to get here), or raise why not."""
    try:
        os.close(os.open("/tmp/unlinks-a-file", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    path = os.path.join(os.path.dirname(os.readlink("/proc/self/fd/1")), "unlinked")  # in its run's folder
    out = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.unlink(path)
    HELD.append(out)
    limit = int(os.environ["DDP_GRADE_SANDBOXED"])  # the tmp limit, in bytes
    for _ in range(limit // len(CHUNK) + 64):
        os.write(out, CHUNK)


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    unlink()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
