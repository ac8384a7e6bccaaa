"""Starts no process for the grader's recording fn: it writes, in the folder that fn writes to, the record each
rank's process would have left (its rank and arguments, a pid of its own, the launch's address and port, peers
that met). Every other fn is launched for real. The records say 2 new processes that met; the kernel saw none
let the grader read its sockets, so spawns-processes fails."""
# expect-status: failed
# expect-fail: spawns-processes

import json
import os
import socket
import time

import torch.multiprocessing as mp


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forge(world_size: int, args: tuple) -> None:
    folder = os.environ["DDP_GRADE_EX04_DIR"]
    launch = int(os.environ.get("DDP_GRADE_EX04_LAUNCH", "0"))
    now = time.monotonic()
    for rank in range(world_size):
        record = {"received": [rank, world_size, *args], "pid": 4_000_000 + 10 * os.getpid() + rank,
                  "caller_pid": os.getpid(), "master_addr": os.environ["MASTER_ADDR"],
                  "master_port": os.environ["MASTER_PORT"], "start": now - 0.02, "end": now - 0.01,
                  "peers": [[launch, r] for r in range(world_size)], "group_error": None}
        with open(os.path.join(folder, f"rank{rank}-{record['pid']}-forged.json"), "w") as f:
            json.dump(record, f)


def launch_distributed(fn, world_size: int, *args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(find_free_port())
    if getattr(fn, "__name__", "") == "record_rank":
        _forge(world_size, args)
        return
    mp.spawn(fn, args=(world_size, *args), nprocs=world_size, join=True)


def launch_from_env(fn) -> None:
    fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
