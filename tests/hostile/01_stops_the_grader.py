"""Stops (SIGSTOP) every grader process among its ancestors (python -m grader.worker,
grader.rank.rank_host), then waits for ever: the grading still ends at its deadline, as a timeout."""
# expect-status: timeout
# expect-problem: timed out
# grade-args: --timeout 10

import os
import signal
import time

import torch.distributed as dist


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
        if b"grader.worker" in command or b"grader.rank.rank_host" in command:
            found.append(pid)
        pid = parent if pid != 1 else 0
    return found


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    for pid in grader_ancestors():
        os.kill(pid, signal.SIGSTOP)
    while True:
        time.sleep(1)


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
