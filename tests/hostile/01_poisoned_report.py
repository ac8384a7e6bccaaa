"""Sends the grader a report of its own whose unpickling would call a function of its choosing
in the grader's process (here print, to show whether it ran); the grader unpickles nothing a rank sends."""
# expect-status: failed
# expect-problem: could not read this rank's report
# expect-problem: not a message of the grader's wire
# expect-absent: THE GRADER RAN LEARNER CODE

import os
import pickle

import torch
import torch.distributed as dist

import grader.rank.child


class Poison:
    def __reduce__(self):
        return print, ("THE GRADER RAN LEARNER CODE",)


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend or "gloo", rank=rank, world_size=world_size)
    # The line the grader reads this rank's report from, found in the grader's own module.
    grader.rank.child._CONN.send_bytes(pickle.dumps({"status": "ok", "result": Poison()}))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
