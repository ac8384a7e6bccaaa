"""Exercise 04, broken: find_free_port returns the port as a str, ready for os.environ. The launches
work, but the helper breaks every caller that binds the port or hands it to a TCPStore."""
# expect-fail: find-free-port
# expect-pass: free-port keeps-set-port

import os
import socket

import torch.multiprocessing as mp


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])  # MASTER_PORT is a string anyway


def launch_distributed(fn, world_size: int, *args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", find_free_port())
    mp.spawn(fn, args=(world_size, *args), nprocs=world_size, join=True)


def launch_from_env(fn) -> None:
    fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
