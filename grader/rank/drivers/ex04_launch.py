"""Exercise 04, rank side: what runs in the processes the learner's launcher starts (record the call, meet the
peers, or fail), in each grader rank (a caller of the learner's launch_distributed, find_free_port and
launch_from_env, or torchrun's start), and the script torchrun runs: this very file (``python rank.py
LEARNER_FILE FOLDER``, :func:`torchrun_entry`) imports the learner's file and calls its launch_from_env.
Only the standard library is imported here: torchrun runs the file as a script."""

from __future__ import annotations

import glob
import importlib.util
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import traceback
import uuid
from datetime import timedelta

# What the grader passes to fn after (rank, world_size).
EXTRA_ARGS = ("ddp-grade", 7)
# How a recording function finds its folder, its caller and its launch.
ENV_DIR = "DDP_GRADE_EX04_DIR"
ENV_CALLER = "DDP_GRADE_EX04_CALLER_PID"
ENV_WORLD_SIZE = "DDP_GRADE_EX04_WORLD_SIZE"
ENV_LAUNCH = "DDP_GRADE_EX04_LAUNCH"
# Fresh interpreters importing torch start seconds apart on a busy machine: the
# ranks of one launch first wait for each other (through files in their own
# folder, which no port mix-up can cross), then join with a short timeout.
PEER_WAIT_S = 30.0
JOIN_TIMEOUT_S = 5.0
BARRIER_TIMEOUT_S = 20.0
# launch_from_env called directly: an environment where RANK and LOCAL_RANK differ
# (the second process of the second machine, two processes per machine).
DIRECT_ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
ENTRY_SCRIPT = os.path.abspath(__file__)  # what torchrun starts in each process: this file (torchrun_entry)
GOOD_ADDRESSES = ("127.0.0.1", "localhost")
PRESET_ADDR = "localhost"
FIND_PORT_CALLS = 3  # find_free_port called directly this many times
UNSET = {"MASTER_ADDR": None, "MASTER_PORT": None, "TORCHELASTIC_USE_AGENT_STORE": None,
         "TORCHELASTIC_RESTART_COUNT": None}


# --- in the processes the learner's launcher starts -------------------------------------------


def record_rank(*received) -> None:
    """The fn given to launch_distributed: record what arrived, meet the peers, record who came."""
    started = time.monotonic()
    record = {
        "received": [_as_data(a) for a in received],
        "pid": os.getpid(),
        "caller_pid": int(os.environ.get(ENV_CALLER, "-1")),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "master_port": os.environ.get("MASTER_PORT"),
        "start": started,
        "peers": None,
        "group_error": None,
    }
    try:
        record["peers"] = _meet_peers(received, record)
    except Exception as exc:  # a failed meeting is an observation, not a crash
        record["group_error"] = f"{type(exc).__name__}: {exc}"[:400]
    record["end"] = time.monotonic()
    _write_record(os.environ[ENV_DIR], record)
    _exit_now(record["pid"] != record["caller_pid"])


def _exit_now(in_new_process: bool) -> None:
    """End a process the launcher started at once, skipping seconds of interpreter teardown.

    Its exit status is 0, as if fn had returned. (Never the caller's own process.)
    """
    if in_new_process:
        os._exit(0)


def _meet_peers(received, record):
    """Join a gloo group through MASTER_ADDR / MASTER_PORT and all-gather (launch, rank)."""
    import torch
    import torch.distributed as dist

    world_size = int(os.environ[ENV_WORLD_SIZE])
    rank = received[0] if received else None
    if record["pid"] == record["caller_pid"]:
        record["group_error"] = "not tried: this is the caller's own process"
        return None
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        record["group_error"] = f"not tried: the first argument {rank!r} is not a rank"
        return None
    folder = os.environ[ENV_DIR]
    open(os.path.join(folder, f"started.{rank}"), "w").close()
    deadline = time.monotonic() + PEER_WAIT_S
    while not all(os.path.exists(os.path.join(folder, f"started.{r}")) for r in range(world_size)):
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not os.path.exists(os.path.join(folder, f"started.{r}"))]
            raise RuntimeError(f"rank(s) {missing} of this launch did not start within {PEER_WAIT_S:g} s")
        time.sleep(0.02)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    try:
        mine = torch.tensor([int(os.environ[ENV_LAUNCH]), rank], dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine)
        _ask_to_be_counted()
        dist.barrier()  # no process of the launch closes a connection before every one was counted
        return [t.tolist() for t in gathered]
    finally:
        dist.destroy_process_group()


def _ask_to_be_counted() -> None:
    """Where the grader counts the run's traffic, have it read this process's sockets while the group is open:
    the kernel, not this record, then says which processes the launch started and that they met."""
    try:
        from grader.rank.sock_diag import ask_to_be_counted
    except ImportError:  # torchrun's script, where the grader's package is not on the path
        return
    ask_to_be_counted()


def record_then_fail(*received) -> None:
    """The fn of the failing launch: record what arrived and saw; then the last rank raises, the others return."""
    now = time.monotonic()
    _write_record(os.environ[ENV_DIR], {"received": [_as_data(a) for a in received], "pid": os.getpid(),
                                        "master_addr": os.environ.get("MASTER_ADDR"),
                                        "master_port": os.environ.get("MASTER_PORT"), "start": now, "end": now})
    last = int(os.environ[ENV_WORLD_SIZE]) - 1
    if received and received[0] == last:
        raise RuntimeError(f"rank {last} fails on purpose (the grader's test of raises-on-failure)")
    _exit_now(os.getpid() != int(os.environ.get(ENV_CALLER, "-1")))


def _as_data(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_as_data(v) for v in value]
    return repr(value)[:200]


def _write_record(folder: str, record: dict) -> None:
    first = record["received"][0] if record["received"] else None
    name = f"rank{first if isinstance(first, int) else 'x'}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = os.path.join(folder, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(folder, f"{name}.json"))


def _read_records(folder: str) -> list[dict]:
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            records.append(json.load(f))
    return records


# --- in each grader rank (a caller of the learner's code) -------------------------------------


def main(ctx) -> dict:
    """Ranks 0 and 1: launch at the same moment. Rank 2: torchrun, launch_from_env, a failing launch."""
    ctx.kwargs["deadline"] = time.monotonic() + ctx.timeout_s - 5.0  # leave time to report
    world_size = ctx.kwargs["world_size"]
    obs = {"caller_pid": os.getpid()}
    if ctx.rank < 2:
        launch_distributed = ctx.function("launch_distributed")
        _file_barrier(ctx.run_dir, "start", ctx.rank, 2)
        obs["concurrent"] = _launch(ctx, launch_distributed, record_rank, world_size, f"concurrent{ctx.rank}")
        return obs
    obs["find_free_port"] = _call_find_free_port(ctx)
    launch_from_env = ctx.function("launch_from_env")
    obs["direct"] = _direct_call(launch_from_env)
    if obs["direct"].get("not_implemented"):
        torchrun = None
    else:
        torchrun = _start_torchrun(ctx, world_size)  # runs while this process does the rest
    try:
        launch_distributed = ctx.function("launch_distributed")
        # MASTER_ADDR / MASTER_PORT already set: the launcher must keep them. The
        # processes do not bind the port, so it cannot collide with anything.
        os.environ["MASTER_ADDR"] = PRESET_ADDR
        os.environ["MASTER_PORT"] = str(ctx.kwargs["preset_port"])
        obs["failing"] = _launch(ctx, launch_distributed, record_then_fail, world_size, "failing")
    except BaseException:
        if torchrun is not None:
            torchrun[0].kill()
        raise
    if torchrun is not None:
        obs["torchrun"] = _finish_torchrun(*torchrun)
    return obs


def _launch(ctx, launch_distributed, fn, world_size: int, name: str) -> dict:
    folder = os.path.join(ctx.run_dir, name)
    os.makedirs(folder)
    os.environ.update({ENV_DIR: folder, ENV_CALLER: str(os.getpid()), ENV_WORLD_SIZE: str(world_size),
                       ENV_LAUNCH: str(ctx.rank + 1)})
    started = time.monotonic()
    error = None
    try:
        launch_distributed(fn, world_size, *EXTRA_ARGS)
    except NotImplementedError:
        raise
    except Exception as exc:  # whether it raises is what some checks look at
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:400]
    returned = time.monotonic()
    # A launcher that did not wait leaves processes running: let them finish and record.
    deadline = ctx.kwargs["deadline"]
    while len(glob.glob(os.path.join(folder, "*.json"))) < world_size and multiprocessing.active_children() \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"started": started, "returned": returned, "error": error, "records": _read_records(folder)}


def _file_barrier(folder: str, name: str, rank: int, world_size: int) -> None:
    open(os.path.join(folder, f"{name}.{rank}"), "w").close()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not all(os.path.exists(os.path.join(folder, f"{name}.{r}")) for r in range(world_size)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the grader's callers did not all start within {BARRIER_TIMEOUT_S:g} s")
        time.sleep(0.01)


def _call_find_free_port(ctx) -> dict:
    """Call the learner's find_free_port a few times; after each call, try to bind what it returned
    (on 127.0.0.1, where the launch's rank 0 would listen) before anything else can take it."""
    module = ctx.learner()
    if not callable(getattr(module, "find_free_port", None)):
        return {"missing": True, "calls": []}
    calls = []
    for _ in range(FIND_PORT_CALLS):
        call = {"type": None, "value": None, "error": None, "bind_error": None}
        try:
            port = module.find_free_port()
        except Exception as exc:  # NotImplementedError included: the helper is part of the statement
            call["error"] = f"{type(exc).__name__}: {exc}"[:300]
            calls.append(call)
            break
        call["type"], call["value"] = type(port).__name__, repr(port)[:100]
        if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", port))
            except OSError as exc:
                call["bind_error"] = f"{type(exc).__name__}: {exc}"[:300]
        calls.append(call)
    return {"missing": False, "calls": calls}


def _direct_call(launch_from_env) -> dict:
    calls = []
    saved = {k: os.environ.get(k) for k in DIRECT_ENV}
    os.environ.update(DIRECT_ENV)
    error = None
    try:
        launch_from_env(lambda *received: calls.append([_as_data(a) for a in received]))
    except NotImplementedError:
        return {"calls": calls, "error": None, "not_implemented": True}
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:400]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"calls": calls, "error": error}


def _start_torchrun(ctx, world_size: int):
    folder = os.path.join(ctx.run_dir, "torchrun")
    os.makedirs(folder)
    log_path = os.path.join(ctx.run_dir, "torchrun.log")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "DDP_GRADE_EX04_")) and k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # what torchrun would set, without its warning
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
               ENTRY_SCRIPT, ctx.learner_path, folder]
    log = open(log_path, "wb")
    # Same process group as this rank: if the grader stops us, it stops torchrun too.
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    timeout = max(5.0, min(60.0, ctx.timeout_s - 5.0))
    return process, log, log_path, folder, time.monotonic(), timeout


def _finish_torchrun(process, log, log_path, folder, started, timeout) -> dict:
    try:
        returncode = process.wait(timeout=max(0.1, started + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        returncode = None
    log.close()
    with open(log_path, "rb") as f:
        output = f.read().decode("utf-8", errors="replace")
    return {"returncode": returncode, "timeout_s": timeout, "seconds": time.monotonic() - started,
            "records": _read_records(folder), "errors": _read_errors(folder), "output": output[-3000:]}


def _read_errors(folder: str) -> list[str]:
    errors = []
    for path in sorted(glob.glob(os.path.join(folder, "*.error"))):
        with open(path) as f:
            errors.append(f.read()[:1000])
    return errors


# --- in each process torchrun starts: this file, run as a script ------------------------------


def record_torchrun_call(*received) -> None:
    """The fn the torchrun entry gives to launch_from_env: write down the call."""
    out = {
        "received": [v if isinstance(v, (int, float, str, type(None))) else repr(v)[:200] for v in received],
        "pid": os.getpid(),
        "env_rank": os.environ.get("RANK"),
        "env_local_rank": os.environ.get("LOCAL_RANK"),
        "env_world_size": os.environ.get("WORLD_SIZE"),
    }
    name = f"call-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    folder = os.environ["DDP_GRADE_EX04_TORCHRUN_DIR"]
    with open(os.path.join(folder, f".{name}.tmp"), "w") as f:
        json.dump(out, f)
    os.replace(os.path.join(folder, f".{name}.tmp"), os.path.join(folder, f"{name}.json"))


def _import_learner(path: str):
    path = os.path.abspath(path)
    sys.path.insert(0, os.path.dirname(path))
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def torchrun_entry() -> None:
    """``python rank.py LEARNER_FILE FOLDER``, started by torchrun: launch_from_env(record_torchrun_call)."""
    learner_path, folder = sys.argv[1], sys.argv[2]
    # Processes the learner may start from here find the folder through the environment.
    os.environ["DDP_GRADE_EX04_TORCHRUN_DIR"] = folder
    try:
        _import_learner(learner_path).launch_from_env(record_torchrun_call)
    except BaseException as exc:
        lines = traceback.format_exception_only(type(exc), exc)
        with open(os.path.join(folder, f"rank{os.environ.get('RANK')}.error"), "w") as f:
            f.write("".join(lines).strip())
        raise
    os._exit(0)  # the record is written: skip seconds of interpreter teardown


if __name__ == "__main__":
    torchrun_entry()
