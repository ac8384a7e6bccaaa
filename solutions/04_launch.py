"""Exercise 04: launch one process per rank.

A DDP job is one process per rank. Either your code starts them itself, or a
launcher (torchrun) starts them and tells each one who it is through the
environment. Write both entry points:

    find_free_port() -> int
        A helper: a TCP port that nothing on this machine is using now.
    launch_distributed(fn, world_size, *args)
        Run fn(rank, world_size, *args) for every rank 0 .. world_size - 1, each
        in a new process, with torch.multiprocessing.spawn.
        - Before spawning, set MASTER_ADDR to 127.0.0.1 and MASTER_PORT to a
          free port, but only when they are unset (a caller may have chosen).
          Two jobs launched at the same time on one machine must not collide.
        - Return only when every process has finished.
        - If any process fails, raise in the caller.
    launch_from_env(fn)
        The entry point of a script started by
            torchrun --standalone --nproc_per_node=N your_script.py
        torchrun has already started one process per rank and set RANK,
        LOCAL_RANK and WORLD_SIZE in each; call fn(rank, world_size) with the
        global rank.

`fn` joins the process group itself (as in exercise 01), reading MASTER_ADDR
and MASTER_PORT from the environment the processes inherit. It is defined at
the top level of a module: spawn sends it to the new processes by name.

Grade it with:  ddp-grade exercises/04_launch.py
"""

import os
import socket

import torch.multiprocessing as mp


def find_free_port() -> int:
    # Port 0 asks the system for any free port; read back which one it gave.
    # The port is free again once this socket closes, so rank 0 must bind it
    # soon: another program could take it in between (rarely, but it happens).
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
    mp.spawn(fn, args=(world_size, *args), nprocs=world_size, join=True)


def launch_from_env(fn) -> None:
    # RANK is global; LOCAL_RANK only counts the processes on this machine
    # (use it to pick the GPU, not as the rank).
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    fn(rank, world_size)
