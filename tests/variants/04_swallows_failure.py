"""Exercise 04, broken: catches the failure of a rank and carries on."""
# expect-fail: raises-on-failure

import os
import socket

import torch.multiprocessing as mp


def find_free_port() -> int:
    # Port 0 asks the system for any free port; read back which one it gave.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_distributed(fn, world_size: int, *args) -> None:
    # The spawned processes inherit this environment: that is how they find rank 0.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(find_free_port())

    # spawn calls fn(rank, *args) in each process, so the rank is not in args.
    # join=True waits for all of them and raises here if one of them fails.
    try:
        mp.spawn(fn, args=(world_size, *args), nprocs=world_size, join=True)
    except Exception as exc:
        print(f"a rank failed: {exc}")


def launch_from_env(fn) -> None:
    # RANK is global; LOCAL_RANK only counts the processes on this machine
    # (use it to pick the GPU, not as the rank).
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    fn(rank, world_size)
