"""Right, and one of its processes tries, one after the other, to hold what no reading of the grader's sees:
2 GiB in a memfd (closed behind a one-page mapping), then in System V shared memory (detached); a file 64 MiB
over the tmp limit in the ranks' folder, unlinked first and held open; a chain of 30,000 folders there, each
made from the last (deeper than PATH_MAX, so no walk by path reaches its end); 5,000 threads at once. Graded
with --memory-limit 1792 --tmp-limit 64, it passes if it keeps any of them; each is refused by a limit the
kernel holds in the sandbox (ENOSYS, a tmpfs's size, its number of files, the task limit), and the file
fails naming how each was stopped."""

import ctypes
import mmap
import os
import threading
from datetime import timedelta

import torch.distributed as dist

HOLD = 2 * 2**30
CHUNK = b"\1" * 2**20
DEPTH = 30_000
BURST = 5_000
HELD: list = []


def hidden_memory() -> list[str]:
    """2 GiB out of every resident set, or why not."""
    try:
        fd = os.memfd_create("hidden")
        for _ in range(HOLD // len(CHUNK)):
            os.write(fd, CHUNK)
        HELD.append(mmap.mmap(fd, mmap.PAGESIZE))  # keeps the memfd alive once its descriptor is closed
        os.close(fd)
        return []
    except OSError as exc:
        stopped = [f"memfd_create: {exc.strerror}"]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    segment = libc.shmget(0, ctypes.c_size_t(HOLD), 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if segment >= 0:
        address = libc.shmat(segment, None, 0)
        if address not in (None, ctypes.c_void_p(-1).value):
            for offset in range(0, HOLD, len(CHUNK)):
                ctypes.memset(address + offset, 1, len(CHUNK))
            libc.shmdt(ctypes.c_void_p(address))  # detached: the segment stays, in no process
            return []
    return stopped + [f"shmget: {os.strerror(ctypes.get_errno())}"]


def unlinked_file(folder: int) -> list[str]:
    """64 MiB over the tmp limit in a file no walk finds, or why not."""
    out = os.open("unlinked", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=folder)
    os.unlink("unlinked", dir_fd=folder)
    limit = int(os.environ["DDP_GRADE_SANDBOXED"])  # the tmp limit, in bytes
    written = 0
    try:
        for _ in range(limit // len(CHUNK) + 64):
            written += os.write(out, CHUNK)
    except OSError as exc:
        os.close(out)
        return [f"unlinked file: {exc.strerror} after {written // 2**20} MiB"]
    HELD.append(out)
    return []


def deep_folders(folder: int) -> list[str]:
    """A chain of DEPTH folders, or why not (what was made is taken down again, level by level)."""
    made, fd = 0, os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=folder)
    name, stopped = "n", []
    try:
        while made < DEPTH:
            os.mkdir(name, dir_fd=fd)
            deeper = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, name, made = deeper, "d", made + 1
    except OSError as exc:
        stopped = [f"folders: {exc.strerror} after {made:,}"]
    os.close(fd)
    if stopped:
        while True:  # n/d moves up beside n, n goes, the moved one takes its name
            try:
                os.rename("n/d", "m", src_dir_fd=folder, dst_dir_fd=folder)
            except FileNotFoundError:
                os.rmdir("n", dir_fd=folder)
                break
            os.rmdir("n", dir_fd=folder)
            os.rename("m", "n", src_dir_fd=folder, dst_dir_fd=folder)
    return stopped


def task_burst() -> list[str]:
    """BURST threads running at once, or why not."""
    threading.stack_size(256 * 2**10)
    release = threading.Event()
    started = 0
    try:
        for _ in range(BURST):
            threading.Thread(target=release.wait, daemon=True).start()
            started += 1
    except RuntimeError as exc:
        return [f"threads: {exc} after {started:,}"]
    finally:
        release.set()
    return []


def escape() -> None:
    """Once per sandbox (the first process to get here); raises with how each try was stopped."""
    try:
        os.close(os.open("/tmp/escapes-the-limits", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    folder = os.open(os.path.dirname(os.readlink("/proc/self/fd/1")), os.O_RDONLY | os.O_DIRECTORY)  # its run's
    stopped = hidden_memory() + unlinked_file(folder) + deep_folders(folder) + task_burst()
    os.close(folder)
    if len(stopped) == 5:
        raise RuntimeError("held nothing out of sight: " + "; ".join(stopped))


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    escape()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
