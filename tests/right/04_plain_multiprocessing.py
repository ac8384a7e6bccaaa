"""Launching with the standard library's multiprocessing: one spawned Process per rank, joined,
exit codes checked."""

import multiprocessing
import os
import socket


def find_free_port():
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
    finally:
        s.close()


def launch_distributed(fn, world_size, *args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    ctx = multiprocessing.get_context("spawn")
    processes = [ctx.Process(target=fn, args=(rank, world_size, *args), name=f"rank-{rank}")
                 for rank in range(world_size)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    failed = [(p.name, p.exitcode) for p in processes if p.exitcode != 0]
    if failed:
        raise RuntimeError("ranks failed: " + ", ".join(f"{name} exit code {code}" for name, code in failed))


def launch_from_env(fn):
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    print(f"rank {rank} of {world_size} (local rank {local_rank})", flush=True)
    fn(rank, world_size)
