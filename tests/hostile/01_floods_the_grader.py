"""Writes 1 GiB without a newline, a MiB at a time, into every pipe but stdin of every grader process
among its ancestors that it can open (python -m grader.worker, unsandboxed: its answers; the warm pool,
which holds the error output of the process that started it: in a sandbox, the one the grader reads;
the sandbox's host is out of its reach); with none, into its own output, which the output limit stops.
Graded plain, the pool's server is in its reach: the flood may end it (the grader starts a new one) or write
into the pipe that carries a rank's exit status, so the problem shown is its own RuntimeError or a rank that
"exited with code 8680820740569200760" (eight x's): failed either way, with a problem that names a rank (not
the grader's own error), which is all this file expects. In a sandbox nothing of the grader's is in reach, and
test_containment expects its own RuntimeError there."""
# expect-status: failed
# expect-problem: ! rank 

import os
import select

import torch.distributed as dist

CHUNK = b"x" * 2**20


def grader_ancestors() -> list[int]:
    found, pid = [], os.getppid()
    while pid > 0:  # up to the sandbox's first process (pid 1) included
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if b"grader.worker" in command or b"rank_host" in command or b"multiprocessing.forkserver" in command:
            found.append(pid)
        pid = parent if pid != 1 else 0
    return found


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    targets = []
    for pid in grader_ancestors():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # not even listed: a process that is not dumpable, seen by another user
            continue
        for fd in fds:
            try:
                if fd != "0" and os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:"):
                    targets.append(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
    targets = targets or ["/proc/self/fd/1"]
    for target in targets:
        try:
            out = os.open(target, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        sent = 0
        while sent < 2**30:
            if not select.select([], [out], [], 1.0)[1]:  # a pipe nobody reads is left after a second
                break
            try:
                sent += os.write(out, CHUNK)
            except BlockingIOError:
                continue
            except OSError:  # the reader is gone
                break
        os.close(out)
    raise RuntimeError("flooded")


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
