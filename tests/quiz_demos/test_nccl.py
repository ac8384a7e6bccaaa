"""Demonstrations for the quiz topic 'nccl' (grader/quiz/bank/nccl.toml).

NCCL itself needs GPUs; what can run on CPU runs here: the gloo counterparts of the interface
variable, the flight recorder (which records gloo collectives too), the defaults, and the
argument checks of init_process_group. torchrun's TORCH_NCCL_ASYNC_ERROR_HANDLING default is
shown in test_elastic.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def no_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _world_of_one(**kwargs):
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, **kwargs)


def test_device_id_must_be_an_accelerator_with_an_index(no_group):
    with pytest.raises(ValueError, match="accelerator with an index"):
        _world_of_one(device_id=torch.device("cpu"))
    assert not dist.is_initialized()


def test_gloo_socket_ifname_picks_the_interface(no_group, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    _world_of_one()
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.destroy_process_group()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(RuntimeError, match="nosuchif0"):
        _world_of_one()
    assert not dist.is_initialized()


def test_default_timeouts():
    from torch.distributed import constants

    assert constants.default_pg_timeout == timedelta(minutes=30)
    if dist.is_nccl_available():
        assert constants.default_pg_nccl_timeout == timedelta(minutes=10)
    else:
        assert constants.default_pg_nccl_timeout is None   # a build without NCCL


FLIGHT_RECORDER_SCRIPT = textwrap.dedent("""
    import json, pickle, sys
    import torch, torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.barrier()
    dump = pickle.loads(_dump_fr_trace())
    dist.destroy_process_group()
    entries = [{"name": e["profiling_name"], "seq": e["collective_seq_id"],
                "sizes": e["input_sizes"], "state": e["state"]} for e in dump["entries"]]
    print(json.dumps({"keys": sorted(dump), "entries": entries}))
""")


@pytest.fixture(scope="module")
def flight_recorder():
    """One fresh process: the recorder's size is read once per process."""
    env = {**os.environ, "TORCH_NCCL_TRACE_BUFFER_SIZE": "2"}
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    done = subprocess.run([sys.executable, "-c", FLIGHT_RECORDER_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.slow
def test_flight_recorder_keeps_the_last_n_collectives(flight_recorder):
    dump, _ = flight_recorder
    assert {"entries", "pg_config", "version"} <= set(dump["keys"])
    # Three collectives ran; a buffer of 2 keeps the last two, with sequence ids and sizes.
    assert [(e["name"], e["seq"]) for e in dump["entries"]] == [("gloo:broadcast", 2), ("gloo:barrier", 3)]
    assert dump["entries"][0]["sizes"] == [[3]]


@pytest.mark.slow
def test_old_trace_buffer_variable_is_deprecated_for_torch_fr_buffer_size(flight_recorder):
    _, stderr = flight_recorder
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated" in stderr
    assert "TORCH_FR_BUFFER_SIZE" in stderr
