"""A right answer whose every rank sends, in place of its report, a well-formed message of the grader's wire
of 10 MB: one dict whose key is a tuple nested 333,333 deep. As a pickle, a key like it made hash() recurse
in C until the deciding process died (SIGSEGV, exit 139, no report). The grader measures the nesting and
counts the values before it parses anything, and refuses the report: the submission's failure."""
# expect-status: failed
# expect-problem: could not read this rank's report
# expect-problem: values where 1,000,000 are left to read
# expect-absent: All 8 checks passed

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

DEPTH = 10**7 // 30
KEY = b'{"\\u0000":"tuple","items":[' * DEPTH + b"1" + b"]}" * DEPTH
HEADER = b'{"status":"ok","result":{"\\u0000":"dict","items":[[' + KEY + b',1]]}}'
MESSAGE = b"DDPW" + len(HEADER).to_bytes(8, "little") + HEADER


def _forge() -> None:
    """Whatever this rank sends is MESSAGE: the grader's encoder, in this process, is the learner's to patch."""
    sys.modules["grader.rank.wire"].dumps = lambda payload: MESSAGE


_forge()


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
