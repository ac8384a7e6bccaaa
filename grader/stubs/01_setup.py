"""Exercise 01: join and leave a process group.

Every process of a distributed job calls setup_ddp once, with its own rank and
the shared world size, before any collective; cleanup_ddp at the end.

    setup_ddp(rank, world_size, backend=None)
        Join the default process group as `rank` of `world_size`.
        - Meet where MASTER_ADDR / MASTER_PORT say; only when they are unset,
          default them to 127.0.0.1 / 29500.
        - backend=None: "nccl" when CUDA has at least `world_size` GPUs, else "gloo".
        - With NCCL, pin this process to its own GPU before any collective.
        - Pass a timeout of at most 5 minutes.
    cleanup_ddp()
        Destroy the default process group; do nothing when there is none.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/01_setup.py      (stuck? ddp-grade hint 01)
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    # TODO: default MASTER_ADDR / MASTER_PORT, choose the backend, set the GPU
    # for NCCL, and join the group with a timeout of at most 5 minutes.
    raise NotImplementedError


def cleanup_ddp() -> None:
    # TODO: destroy the default process group, if there is one.
    raise NotImplementedError
