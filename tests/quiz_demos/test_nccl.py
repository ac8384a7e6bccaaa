"""Demonstrations for the quiz topic 'nccl' (grader/quiz/bank/nccl.toml).

NCCL itself needs GPUs; what can run on CPU runs here: the gloo counterparts of the interface
variable, the flight recorder (which records gloo collectives too), the defaults, and the
argument checks of init_process_group. torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING default is
shown in test_elastic.py.

The process-group claims run in one rank started by the grader's harness (a fresh process, so the
flight recorder reads its buffer size from the environment the test gives it), which makes its
own worlds of one on a store it holds.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from quiz_demos.world import run_world


def world_of_one(**kwargs) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, **kwargs)


def attempt_init(**kwargs) -> str:
    """Make a world of one and tear it down again; what init_process_group raised, if anything."""
    try:
        world_of_one(**kwargs)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()
    return "accepted"


def nccl_main(ctx) -> dict:
    from torch._C._distributed_c10d import _dump_fr_trace

    out = {"device_id_cpu": attempt_init(device_id=torch.device("cpu"))}
    out["initialized_after_device_id_cpu"] = dist.is_initialized()

    # Three collectives on gloo, recorded by the flight recorder (buffer size from the environment).
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    world_of_one()
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.barrier()
    out["all_reduce_on_lo"] = t.tolist()
    dump = pickle.loads(_dump_fr_trace())
    dist.destroy_process_group()
    out["fr_keys"] = sorted(dump)
    out["fr_entries"] = [{"name": e["profiling_name"], "seq": e["collective_seq_id"],
                          "sizes": e["input_sizes"], "state": e["state"]} for e in dump["entries"]]

    os.environ["GLOO_SOCKET_IFNAME"] = "nosuchif0"
    out["unknown_interface"] = attempt_init()
    out["initialized_after_unknown_interface"] = dist.is_initialized()

    # What torch printed (C++ warnings included): the harness sends it to this file.
    sys.stderr.flush()
    with open(os.path.join(ctx.run_dir, f"rank{ctx.rank}.out"), encoding="utf-8", errors="replace") as f:
        out["output"] = f.read()
    return out


@pytest.fixture(scope="module")
def nccl(session):
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2", "TORCH_FR_BUFFER_SIZE": None}
    return run_world(session, "quiz_demos.test_nccl:nccl_main", 1, timeout_s=120, env=env)[0]


@pytest.mark.slow
def test_device_id_must_be_an_accelerator_with_an_index(nccl):
    assert nccl["device_id_cpu"].startswith("ValueError") and "accelerator with an index" in nccl["device_id_cpu"]
    assert nccl["initialized_after_device_id_cpu"] is False


@pytest.mark.slow
def test_gloo_socket_ifname_picks_the_interface(nccl):
    assert nccl["all_reduce_on_lo"] == [1.0, 1.0, 1.0]
    assert nccl["unknown_interface"].startswith("RuntimeError") and "nosuchif0" in nccl["unknown_interface"]
    assert nccl["initialized_after_unknown_interface"] is False


def nccl_default_timeout_in_the_installed_headers() -> timedelta:
    """kProcessGroupNCCLDefaultTimeout, read from ProcessGroupNCCL.hpp as installed with torch.

    Every build ships the C++ headers, with or without NCCL; a build with NCCL exposes the same
    constant as torch.distributed.constants.default_pg_nccl_timeout.
    """
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    found = re.search(r"kProcessGroupNCCLDefaultTimeout\s*=\s*std::chrono::milliseconds\(([\d\s*]+)\)",
                      header.read_text(encoding="utf-8"))
    assert found, f"no kProcessGroupNCCLDefaultTimeout in {header}"
    return timedelta(milliseconds=math.prod(int(n) for n in found.group(1).split("*")))


def test_default_timeouts_are_10_minutes_for_nccl_and_30_for_gloo():
    from torch.distributed import constants
    from torch.distributed.distributed_c10d import Backend, _get_default_timeout

    # What init_process_group uses when no timeout is passed: 30 minutes for gloo ...
    assert _get_default_timeout(Backend("gloo")) == constants.default_pg_timeout == timedelta(minutes=30)
    # ... and 10 minutes for NCCL, the constant of NCCL's process group.
    assert nccl_default_timeout_in_the_installed_headers() == timedelta(minutes=10)
    if dist.is_nccl_available():
        assert constants.default_pg_nccl_timeout == timedelta(minutes=10)
        assert _get_default_timeout(Backend("nccl")) == timedelta(minutes=10)
    # What happens at the end of it, in init_process_group's own words.
    doc = " ".join(dist.init_process_group.__doc__.split())
    assert "Default value is 10 minutes for NCCL and 30 minutes for other backends" in doc
    assert "collectives will be aborted asynchronously and the process will crash" in doc


@pytest.mark.slow
def test_flight_recorder_keeps_the_last_n_collectives(nccl):
    assert {"entries", "pg_config", "version"} <= set(nccl["fr_keys"])
    # Three collectives ran; a buffer of 2 keeps the last two, with sequence ids and sizes.
    assert [(e["name"], e["seq"]) for e in nccl["fr_entries"]] == [("gloo:broadcast", 2), ("gloo:barrier", 3)]
    assert nccl["fr_entries"][0]["sizes"] == [[3]]


@pytest.mark.slow
def test_old_trace_buffer_variable_is_deprecated_for_torch_fr_buffer_size(nccl):
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated" in nccl["output"]
    assert "TORCH_FR_BUFFER_SIZE" in nccl["output"]
