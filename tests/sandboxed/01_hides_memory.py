"""Right, and one of its processes holds 2 GiB that no process's resident memory shows: written into a
memfd that it then closes behind a one-page mapping, or else into System V shared memory that it then
detaches. Graded with --memory-limit 1792, it passes only if it holds them: the sandbox refuses both
(memfd_create and shmget fail with ENOSYS), and the file fails on its own words."""

import ctypes
import mmap
import os
from datetime import timedelta

import torch.distributed as dist

SIZE = 2 * 2**30
CHUNK = b"\1" * 2**26
HELD: list = []


def hold() -> None:
    """Once per sandbox (the first process to get here): 2 GiB out of every resident set, or raise why not."""
    try:
        os.close(os.open("/tmp/holds-memory", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    failed = []
    try:
        fd = os.memfd_create("hidden")
        for _ in range(SIZE // len(CHUNK)):
            os.write(fd, CHUNK)
        HELD.append(mmap.mmap(fd, mmap.PAGESIZE))  # keeps the memfd alive once its descriptor is closed
        os.close(fd)
        return
    except OSError as exc:
        failed.append(f"memfd_create: {exc.strerror}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    segment = libc.shmget(0, ctypes.c_size_t(SIZE), 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if segment >= 0:
        address = libc.shmat(segment, None, 0)
        if address not in (None, ctypes.c_void_p(-1).value):
            for offset in range(0, SIZE, len(CHUNK)):
                ctypes.memset(address + offset, 1, len(CHUNK))
            libc.shmdt(ctypes.c_void_p(address))  # detached: the segment stays, in no process
            return
    failed.append(f"shmget: {os.strerror(ctypes.get_errno())}")
    raise RuntimeError("held nothing out of sight: " + "; ".join(failed))


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    hold()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
