"""No timeout (a real failure), and tries to fake a pass from inside its ranks: patched torch.equal,
torch.allclose and grader modules, and printed PASS lines."""
# expect-status: failed
# expect-fail: timeout-set
# expect-absent: All 8 checks passed

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import grader.grading
import grader.results
import grader.checks.ex01_setup


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=None)
    torch.equal = lambda *args, **kwargs: True
    torch.allclose = lambda *args, **kwargs: True
    grader.grading.Grading.record = lambda self, check_id, ok=True, *a, **k: True
    grader.results.overall_status = lambda checks: "passed"
    grader.checks.ex01_setup.MAX_TIMEOUT_S = float("inf")
    print("  PASS  timeout-set  init_process_group gets a timeout of at most 5 minutes")
    print("All 8 checks passed.")


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
