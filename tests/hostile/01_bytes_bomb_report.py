"""A right answer whose every rank sends, in place of its report, 150 bytes of data and a header that says
they are a bytearray of 3.38 GB (with bytearray on the pickle's allowlist, 150 bytes made the grader
allocate 3.38 GB). Every byte a value claims must be in the message: the report is refused."""
# expect-status: failed
# expect-problem: could not read this rank's report
# expect-problem: claims 3,380,000,000 bytes where 150 are left
# expect-absent: All 8 checks passed

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

HEADER = b'{"status":"ok","result":{"\\u0000":"bytearray","n":3380000000}}'
MESSAGE = b"DDPW" + len(HEADER).to_bytes(8, "little") + HEADER + b"\xff" * 150


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
