"""Exercise 01: setup_ddp / cleanup_ddp: the drivers, run in each rank (the checks that decide:
grader/checks/ex01_setup.py).

Call the learner's setup_ddp with probes on init_process_group, try a collective, clean up twice.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from grader.rank import probes
from grader.rank.child import GraderAbort, RankContext


def rank_main(ctx: RankContext) -> dict:
    """Join through setup_ddp, all-reduce, leave through cleanup_ddp (twice)."""
    calls: list = []
    grader_port = os.environ.get("MASTER_PORT")
    obs = {"grader_port": grader_port, "calls": calls, "aborted": None}
    with probes.watch_init(calls, expected_port=grader_port):
        setup_ddp = ctx.function("setup_ddp")
        cleanup_ddp = ctx.function("cleanup_ddp")
        request = ctx.kwargs.get("backend")
        try:
            if request is not None:
                setup_ddp(ctx.rank, ctx.world_size, backend=request)
            else:
                setup_ddp(ctx.rank, ctx.world_size)
        except GraderAbort as exc:
            obs["aborted"] = str(exc)
            return obs
        except Exception as exc:
            if not ctx.kwargs.get("observe_errors"):
                raise
            obs["setup_error"] = f"{type(exc).__name__}: {exc}"[:300]
            return obs
    obs["initialized"] = dist.is_initialized()
    if not obs["initialized"]:
        return obs
    obs["rank"] = dist.get_rank()
    obs["world_size"] = dist.get_world_size()
    obs["backend"] = str(dist.get_backend())
    device = torch.device("cpu")
    if obs["backend"] == "nccl":  # "cpu:gloo" (asked for by the grader) runs on the CPU
        device = torch.device("cuda", torch.cuda.current_device())
        obs["cuda_device"] = torch.cuda.current_device()
    value = torch.tensor([float(ctx.rank + 1)], device=device)
    dist.all_reduce(value)
    obs["all_reduce"] = value.item()
    cleanup_ddp()
    obs["initialized_after_cleanup"] = dist.is_initialized()
    obs["second_cleanup_error"] = _error_of(cleanup_ddp)
    return obs


def defaults_main(ctx: RankContext) -> dict:
    """With MASTER_ADDR / MASTER_PORT unset: what would setup_ddp use? (Never binds a port.)"""
    calls: list = []
    with probes.watch_init(calls, dry_run=True):
        setup_ddp = ctx.function("setup_ddp")
        cleanup_ddp = ctx.function("cleanup_ddp")
        cleanup_error = _error_of(cleanup_ddp)  # no group yet: must be a no-op
        try:
            setup_ddp(0, 1, backend="gloo")
        except GraderAbort:
            pass
    return {"calls": calls, "cleanup_without_group_error": cleanup_error}


def _error_of(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # the learner's bug is the observation
        return f"{type(exc).__name__}: {exc}"
    return None
