"""Launching with torch.multiprocessing.start_processes and a port from a bound socket; type hints."""

from __future__ import annotations

import os
import socket
from contextlib import closing
from typing import Any, Callable

import torch.multiprocessing as mp


def find_free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def launch_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    if not os.environ.get("MASTER_ADDR"):
        os.environ["MASTER_ADDR"] = "localhost"
    if not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = str(find_free_port())
    context = mp.start_processes(fn, args=(world_size, *args), nprocs=world_size, join=False,
                                 start_method="spawn")
    # join() returns False while processes are still running and raises when one has failed.
    while not context.join():
        pass


def launch_from_env(fn: Callable[[int, int], Any]) -> None:
    env = os.environ
    fn(int(env["RANK"]), int(env["WORLD_SIZE"]))
