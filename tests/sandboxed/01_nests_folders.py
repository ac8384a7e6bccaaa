"""Right, and one of its processes makes a chain of 30,000 folders in the ranks' folder, each made from the
last (deeper than PATH_MAX, so that no walk by path reaches the end, and more files than the folder may
hold). It passes only if it keeps them: the folder is a tmpfs whose number of files the kernel holds
under unshare and the grader counts from outside under bwrap, and the file fails naming the tmp limit."""

import os
from datetime import timedelta

import torch.distributed as dist

DEPTH = 30_000


def nest() -> None:
    """Once per sandbox (the first process to get here), or raise why not."""
    try:
        os.close(os.open("/tmp/nests-folders", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    fd = os.open(os.path.dirname(os.readlink("/proc/self/fd/1")), os.O_RDONLY | os.O_DIRECTORY)  # its run's folder
    for _ in range(DEPTH):
        os.mkdir("d", dir_fd=fd)
        deeper = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(fd)


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    nest()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
