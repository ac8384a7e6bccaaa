"""Topic launch: how mp.spawn calls and reports its workers, what torchrun puts in the environment
and how it restarts, and what env:// needs (on loopback only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT", "NODE_RANK", "TORCHELASTIC_RESTART_COUNT")


def spawned(index: int, folder: str, label: str) -> None:
    """A worker for mp.spawn: records how it was called, then worker 1 fails while worker 0 waits."""
    env = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    record = {"index": index, "folder": folder, "label": label, "env": env}
    Path(folder, f"started{index}.json").write_text(json.dumps(record))
    if index == 1:
        deadline = time.monotonic() + 60
        while not Path(folder, "started0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise ValueError("worker 1 fails on purpose")
    time.sleep(60)  # worker 0 is still busy when worker 1 fails
    Path(folder, "finished0").write_text("")


@pytest.fixture(scope="module")
def spawn_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spawn")
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(spawned, args=(str(folder), "cfg"), nprocs=2, join=True)
    records = [json.loads(Path(folder, f"started{i}.json").read_text()) for i in range(2)]
    return {"error": info.value, "records": records, "folder": folder}


@pytest.mark.slow
def test_spawn_calls_fn_with_the_process_index_first(spawn_run):
    for i, record in enumerate(spawn_run["records"]):
        assert (record["index"], record["folder"], record["label"]) == (i, str(spawn_run["folder"]), "cfg")


@pytest.mark.slow
def test_spawn_sets_no_launcher_variables(spawn_run):
    for record in spawn_run["records"]:
        assert {k: v for k, v in record["env"].items() if v is not None} == {}


@pytest.mark.slow
def test_spawn_raises_process_raised_exception_and_stops_the_others(spawn_run):
    error = spawn_run["error"]
    assert error.error_index == 1 and not isinstance(error, ValueError)
    assert "ValueError: worker 1 fails on purpose" in str(error)  # the child's traceback, as text
    assert not Path(spawn_run["folder"], "finished0").exists()  # worker 0 was terminated, not waited for


WORKER = '''
import json, os, sys, time

names = {names!r}
env = {{name: os.environ.get(name) for name in names}}
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(os.path.join(sys.argv[1], f"attempt{{restart}}-rank{{env['RANK']}}.json"), "w") as f:
    json.dump(env, f)
if restart == 0:
    # The first attempt fails on worker 1 while worker 0 is still busy (once worker 0 has written its
    # record: on a loaded machine it may start later); neither touches the process group, so the
    # second attempt rendezvouses afresh.
    if env["RANK"] == "1":
        while not os.path.exists(os.path.join(sys.argv[1], "attempt0-rank0.json")):
            time.sleep(0.05)
        sys.exit(3)
    time.sleep(120)
    sys.exit(0)
import torch.distributed as dist  # only now: the first attempt needs no torch

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def torchrun(tmp_path_factory):
    folder = tmp_path_factory.mktemp("torchrun")
    script = folder / "worker.py"
    script.write_text(WORKER.format(names=LAUNCH_VARIABLES))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    # A store per attempt, as in test_elastic.py: with the agent's store shared across restarts the restarted
    # workers can read the previous attempt's addresses and fail to connect (pytorch/pytorch#135712, #167288).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    loopback = {"linux": "lo", "darwin": "lo0"}.get(sys.platform.rstrip("0123456789"))
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = loopback  # the workers talk over loopback only
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
         "--monitor-interval", "0.2", str(script), str(folder)],
        env=env, capture_output=True, text=True, timeout=240)
    attempts = {p.stem: json.loads(p.read_text()) for p in folder.glob("attempt*.json")}
    return result, attempts


@pytest.mark.slow
def test_torchrun_sets_the_rank_variables_and_a_free_port(torchrun):
    result, attempts = torchrun
    assert result.returncode == 0, result.stderr[-3000:]
    first = [attempts[f"attempt0-rank{r}"] for r in range(2)]
    for r, env in enumerate(first):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(r), str(r), "2")
        assert (env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("2", "0")
        assert env["MASTER_ADDR"] and env["NODE_RANK"] is None
    ports = {env["MASTER_PORT"] for env in first}
    assert len(ports) == 1 and ports != {"29500"}  # one node, no --master-port: a free port, not 29500


@pytest.mark.slow
def test_torchrun_restarts_every_worker_and_counts_restarts(torchrun):
    result, attempts = torchrun
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(attempts) == ["attempt0-rank0", "attempt0-rank1", "attempt1-rank0", "attempt1-rank1"]
    assert {attempts[f"attempt1-rank{r}"]["TORCHELASTIC_RESTART_COUNT"] for r in range(2)} == {"1"}


def test_env_init_without_master_addr_raises_naming_the_variable(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR expected, but not set"):
        dist.init_process_group("gloo", rank=0, world_size=1)
    assert not dist.is_initialized()
