"""Demonstrations for the quiz topic 'elastic' (grader/quiz/bank/elastic.toml).

One real launch: ``python -m torch.distributed.run --standalone --nproc-per-node 2
--max-restarts 1`` on a small script over loopback. In its first attempt rank 1 skips a
monitored_barrier and rank 0 then exits with an error, so the agent restarts the whole group;
the second attempt finishes. Each worker writes what it saw to a JSON file per attempt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

WORKER = textwrap.dedent('''
    import json, os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    out = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    seen = {
        "argv": sys.argv[1:],
        "pid": os.getpid(),
        "launched_by_torchelastic": dist.is_torchelastic_launched(),
        "env": {k: os.environ.get(k) for k in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "NODE_RANK")},
    }
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))

    if attempt == 0:
        # all_gather_object: count the tensor all_gathers it makes underneath.
        calls = []
        real_all_gather = c10d.all_gather
        def counting_all_gather(*args, **kwargs):
            calls.append(1)
            return real_all_gather(*args, **kwargs)
        c10d.all_gather = counting_all_gather
        gathered = [None] * dist.get_world_size()
        returned = dist.all_gather_object(gathered, {"rank": rank, "text": "x" * (10 * rank)})
        c10d.all_gather = real_all_gather
        seen["all_gather_object"] = {"returned": repr(returned), "gathered": gathered, "all_gathers": len(calls)}

        if rank == 0:
            try:
                dist.monitored_barrier(timeout=timedelta(seconds=2))
                seen["monitored_barrier"] = "passed"
            except RuntimeError as exc:
                seen["monitored_barrier"] = str(exc)
        with open(os.path.join(out, f"attempt{attempt}_rank{rank}.json"), "w") as f:
            json.dump(seen, f)
        if rank == 0:
            sys.exit(3)            # a worker failure: the agent restarts the group
        time.sleep(30)             # rank 1 never reaches the barrier; the agent stops it
        sys.exit(0)

    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    seen["all_reduce"] = t.item()
    dist.destroy_process_group()
    seen["initialized_after_destroy"] = dist.is_initialized()
    with open(os.path.join(out, f"attempt{attempt}_rank{rank}.json"), "w") as f:
        json.dump(seen, f)
''')


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchrun")
    script = root / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.1", str(script), str(out)]
    # With the agent's rendezvous store shared across restarts (the default), the restarted
    # workers can read the previous attempt's gloo addresses from it and fail to connect
    # (pytorch/pytorch#135712, #167288); a store per attempt keeps this demonstration stable.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    loopback = {"linux": "lo", "darwin": "lo0"}.get(sys.platform.rstrip("0123456789"))
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = loopback  # the workers talk over loopback only
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    files = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return done, files


@pytest.mark.slow
def test_group_restart_after_one_worker_fails(launch):
    done, files = launch
    assert done.returncode == 0, done.stderr[-3000:]
    assert set(files) == {"attempt0_rank0", "attempt0_rank1", "attempt1_rank0", "attempt1_rank1"}
    # Both workers ran again, in new processes, with the restart counted.
    for rank in (0, 1):
        before, after = files[f"attempt0_rank{rank}"], files[f"attempt1_rank{rank}"]
        assert after["pid"] != before["pid"]
        assert (before["env"]["TORCHELASTIC_RESTART_COUNT"], after["env"]["TORCHELASTIC_RESTART_COUNT"]) == ("0", "1")
        assert after["env"]["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert after["env"]["TORCHELASTIC_RUN_ID"] == before["env"]["TORCHELASTIC_RUN_ID"]


@pytest.mark.slow
def test_torchrun_environment(launch):
    _, files = launch
    for rank in (0, 1):
        seen = files[f"attempt1_rank{rank}"]
        env = seen["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["NODE_RANK"] is None
        assert seen["launched_by_torchelastic"] is True


@pytest.mark.slow
def test_standalone_uses_a_random_run_id_and_a_free_port(launch):
    _, files = launch
    env = files["attempt0_rank0"]["env"]
    uuid.UUID(env["TORCHELASTIC_RUN_ID"])              # --standalone: a fresh uuid4 run id
    assert env["MASTER_ADDR"] and env["MASTER_PORT"] != "29500"


@pytest.mark.slow
def test_torchrun_sets_nccl_async_error_handling_when_unset(launch):
    _, files = launch
    assert files["attempt0_rank0"]["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


@pytest.mark.slow
def test_torchrun_passes_no_local_rank_argument(launch):
    _, files = launch
    for name, seen in files.items():
        assert len(seen["argv"]) == 1 and not any("local" in a for a in seen["argv"]), name


@pytest.mark.slow
def test_monitored_barrier_names_the_missing_rank(launch):
    _, files = launch
    message = files["attempt0_rank0"]["monitored_barrier"]
    assert "Rank 1" in message and "monitoredBarrier" in message
    assert "monitored_barrier" not in files["attempt0_rank1"]


@pytest.mark.slow
def test_all_gather_object(launch):
    _, files = launch
    for rank in (0, 1):
        got = files[f"attempt0_rank{rank}"]["all_gather_object"]
        assert got["returned"] == "None"                  # fills the list in place
        assert got["gathered"] == [{"rank": 0, "text": ""}, {"rank": 1, "text": "x" * 10}]
        assert got["all_gathers"] == 2                    # sizes first, then the padded bytes


@pytest.mark.slow
def test_destroy_process_group(launch):
    _, files = launch
    for rank in (0, 1):
        seen = files[f"attempt1_rank{rank}"]
        assert seen["all_reduce"] == 3.0
        assert seen["initialized_after_destroy"] is False


def test_torchrun_defaults():
    from torch.distributed.run import parse_args, parse_min_max_nnodes

    args = parse_args(["train.py"])
    assert args.max_restarts == 0
    assert args.nnodes == "1:1" and args.rdzv_backend == "static"
    assert parse_min_max_nnodes("2:4") == (2, 4)
    assert parse_min_max_nnodes("3") == (3, 3)


def test_init_twice_is_refused_and_destroy_allows_a_new_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    for _ in range(2):
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        with pytest.raises(ValueError, match="twice"):
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.destroy_process_group()
        assert not dist.is_initialized()
        with pytest.raises(ValueError, match="not been initialized"):
            dist.get_rank()
