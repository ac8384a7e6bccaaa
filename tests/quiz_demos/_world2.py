"""Run one function on every rank of a small gloo world on 127.0.0.1, under a deadline.

The quiz demonstrations for mixed precision, communication hooks, checkpoints, FSDP and memory
each start one such world per test file (a module-scoped fixture) and assert on what it returns.

    results = run_world(some_module_level_function, world_size=2, args=(...,), timeout_s=120)
    results[rank]  # what the function returned on that rank (plain, picklable data)

The function is called as ``fn(rank, world_size, *args)`` after ``init_process_group("gloo")`` and
before ``destroy_process_group()``. The rendezvous is a ``TCPStore`` held by this process on a port
the OS picked, so no port is hard-coded and none is picked and then lost.
"""

from __future__ import annotations

import pickle
import queue
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


class WorldFailed(AssertionError):
    """A rank raised, died or missed the deadline."""


def _rank_main(fn, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle bytes: tensors are copied, not shared with a process about to exit.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))


def run_world(fn, world_size: int = 2, args: tuple = (), timeout_s: float = 120.0) -> list:
    """``fn(rank, world_size, *args)`` on each rank; the list of what each rank returned."""
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, world_size, store.port, args, results), daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorldFailed(f"ranks {sorted(set(range(world_size)) - set(got))} missed the "
                                  f"{timeout_s:.0f} s deadline")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:
                    raise WorldFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                      "before reporting") from None
                continue
            if status != "ok":
                raise WorldFailed(f"rank {rank} raised:\n{value}")
            got[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [got[r] for r in range(world_size)]
