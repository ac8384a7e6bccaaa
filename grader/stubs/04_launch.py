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

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/04_launch.py      (stuck? ddp-grade hint 04)
"""

import os
import socket

import torch.multiprocessing as mp


def find_free_port() -> int:
    # TODO: return a TCP port that nothing on this machine is listening on.
    raise NotImplementedError


def launch_distributed(fn, world_size: int, *args) -> None:
    # TODO: set MASTER_ADDR and a free MASTER_PORT unless they are set, then
    # run fn(rank, world_size, *args) in world_size new processes, wait for
    # all of them, and let a failure raise here.
    raise NotImplementedError


def launch_from_env(fn) -> None:
    # TODO: read the rank and world size torchrun set in the environment and
    # call fn(rank, world_size).
    raise NotImplementedError
