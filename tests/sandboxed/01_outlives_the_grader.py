"""Leaves a daemon (double fork, a session of its own, named ddp-left-behind) and waits for ever: the
grader is then killed (SIGKILL) while the sandbox runs, and nothing of the sandbox may outlive it."""

import ctypes
import os
import time


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    if rank == 0 and os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, b"ddp-left-behind", 0, 0, 0)  # PR_SET_NAME: what the test looks for
            time.sleep(3600)
        os._exit(0)
    while True:
        time.sleep(1)


def cleanup_ddp() -> None:
    pass
