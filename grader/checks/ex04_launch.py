"""Exercise 04: launch_distributed / launch_from_env.

Rank side: the grader starts three callers. Callers 0 and 1 call the learner's
launch_distributed at the same moment with ``record_rank``, which writes down,
in every process it runs in, what it received and saw (args, pid,
MASTER_ADDR / MASTER_PORT, start and end time) and whom it met in a gloo group
joined through those variables. Caller 2 calls launch_from_env in its own
process with RANK != LOCAL_RANK, starts a real torchrun on a script that calls
launch_from_env, and meanwhile launches a fn that fails in its last rank with
MASTER_ADDR / MASTER_PORT already set. Caller 2 also calls find_free_port
itself a few times and, right after each call, tries to bind what it returned.
Grader side: every verdict is decided from those records.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import timedelta

from grader.checks.interface import Grader

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
ENTRY_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared", "torchrun_entry.py")
GOOD_ADDRESSES = ("127.0.0.1", "localhost")
PRESET_ADDR = "localhost"
FIND_PORT_CALLS = 3  # find_free_port called directly this many times
UNSET = {"MASTER_ADDR": None, "MASTER_PORT": None, "TORCHELASTIC_USE_AGENT_STORE": None,
         "TORCHELASTIC_RESTART_COUNT": None}


# --- in the processes the learner's launcher starts ------------------------------------


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
        return [t.tolist() for t in gathered]
    finally:
        dist.destroy_process_group()


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


# --- in each grader rank (a caller of the learner's code) ------------------------------


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


# --- in the grader --------------------------------------------------------------------


def grade(g: Grader) -> None:
    world_size = g.world_sizes[0]
    preset_port = _free_port()
    callers = g.run(main, 3, kwargs={"world_size": world_size, "preset_port": preset_port}, env=UNSET,
                    label=f"two launches at once, then torchrun (world size {world_size} each; 15-20 s)",
                    graded_size=world_size).results()
    concurrent, pids, last = [c["concurrent"] for c in callers[:2]], [c["caller_pid"] for c in callers[:2]], callers[2]
    check_launches(g, [(f"caller {i}", pids[i], launch) for i, launch in enumerate(concurrent)], world_size)
    check_free_port(g, concurrent, pids, world_size)
    check_find_free_port(g, last["find_free_port"])
    check_raises(g, last["failing"], world_size)
    check_preset(g, last["failing"], preset_port, world_size)
    if last["direct"].get("not_implemented"):
        g.not_implemented("launch_from_env")
    check_direct(g, last["direct"])
    check_torchrun(g, last["torchrun"], world_size)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(values: list) -> str:
    return "(" + ", ".join(repr(v) for v in values) + ("," if len(values) == 1 else "") + ")"


def _raised(launch: dict) -> str:
    return f" (launch_distributed raised {launch['error']})" if launch["error"] else ""


def check_launches(g, launches: list[tuple[str, int, dict]], world_size: int) -> None:
    """spawns-processes, passes-args and waits-for-all, for every launch of record_rank."""
    if not any(launch["records"] for _, _, launch in launches):
        errors = "; ".join(f"{who}{_raised(launch)}" for who, _, launch in launches if launch["error"])
        for check_id in ("passes-args", "waits-for-all"):
            g.record(check_id, False, "fn never ran in any launch, so there is nothing to check"
                     + (f" ({errors})" if errors else ""), world_size=world_size)
    for who, caller_pid, launch in launches:
        records = launch["records"]
        ranks = sorted(r["received"][0] if r["received"] else None for r in records)
        ranks_text = ", ".join(repr(r) for r in ranks) or "none"
        if ranks != list(range(world_size)):
            g.record("spawns-processes", False,
                     f"{who}: fn ran {len(records)} time(s), as rank(s) {ranks_text}; expected each rank "
                     f"0..{world_size - 1} exactly once{_raised(launch)}", world_size=world_size)
        in_caller = [r for r in records if r["pid"] == caller_pid]
        if in_caller:
            g.record("spawns-processes", False,
                     f"{who}: fn ran in the caller's own process (pid {caller_pid}) for rank(s) "
                     f"{', '.join(repr(r['received'][0]) for r in in_caller)}: every rank needs a new process",
                     world_size=world_size)
        pids = [r["pid"] for r in records]
        if len(set(pids)) != len(pids):
            g.record("spawns-processes", False, f"{who}: several ranks ran in one process (pids {pids})",
                     world_size=world_size)
        g.record("spawns-processes", True)

        expected_tail = [world_size, *EXTRA_ARGS]
        for r in sorted(records, key=lambda r: str(r["received"][:1])):
            if r["received"][1:] != expected_tail:
                rank = r["received"][0] if r["received"] else None
                g.record("passes-args", False,
                         f"{who}: launch_distributed(fn, {world_size}, {', '.join(map(repr, EXTRA_ARGS))}) "
                         f"called fn{_args(r['received'])}; expected fn{_args([rank, *expected_tail])}",
                         rank=rank if isinstance(rank, int) else None, world_size=world_size)
                break
        g.record("passes-args", True)

        late = [r for r in records if r["end"] > launch["returned"]]
        if late:
            r = max(late, key=lambda r: r["end"])
            g.record("waits-for-all", False,
                     f"{who}: launch_distributed returned {r['end'] - launch['returned']:.2f} s before "
                     f"rank {r['received'][0] if r['received'] else '?'} finished "
                     f"({len(late)} of {len(records)} rank(s) were still running)", world_size=world_size)
        g.record("waits-for-all", True)


def check_free_port(g, launches: list[dict], caller_pids: list[int], world_size: int) -> None:
    """Two launches at the same moment, addresses left unset: each needs a port of its own."""
    ports = []
    for i, launch in enumerate(launches):
        seen = sorted({(r["master_addr"], r["master_port"]) for r in launch["records"]}, key=str)
        if not seen:
            g.record("free-port", False, f"caller {i}: no rank of the launch recorded anything{_raised(launch)}",
                     world_size=world_size)
            return
        if len(seen) > 1:
            g.record("free-port", False, f"caller {i}: the ranks of one launch saw different addresses: "
                     + ", ".join(f"{a}:{p}" for a, p in seen), world_size=world_size)
            return
        addr, port = seen[0]
        if addr not in GOOD_ADDRESSES or port is None or not str(port).isdigit():
            g.record("free-port", False, f"caller {i}: with MASTER_ADDR and MASTER_PORT unset before the call, "
                     f"fn saw MASTER_ADDR={addr} MASTER_PORT={port}; expected 127.0.0.1 and a port number",
                     world_size=world_size)
            return
        ports.append(port)
    if ports[0] == ports[1]:
        problems = [f"caller {i}'s launch: {problem}" for i, l in enumerate(launches)
                    if (problem := _meeting_problem(l, caller_pids[i], world_size))]
        g.record("free-port", False, f"two launches started at the same moment both used MASTER_PORT={ports[0]}, "
                 "so they collide" + (f" ({'; '.join(problems)})" if problems else
                                      " (this time one happened to finish before the other met)"),
                 world_size=world_size)
        return
    for i, launch in enumerate(launches):
        problem = _meeting_problem(launch, caller_pids[i], world_size)
        if problem:
            g.record("free-port", False, f"caller {i}'s launch on port {ports[i]} (the other used "
                     f"{ports[1 - i]}): {problem}", world_size=world_size)
            return
    g.record("free-port", True)


def check_find_free_port(g, found: dict) -> None:
    """find_free_port() itself: an int (not a str, which only works where it is put into os.environ),
    a TCP port number, that a socket could bind right after the call."""
    if found["missing"]:
        g.record("find-free-port", False, "the file has no find_free_port(): the statement asks for it, "
                 "returning a free TCP port as an int")
        return
    for i, call in enumerate(found["calls"]):
        which = f"call {i + 1} of {len(found['calls'])}" if i else "the first call"
        if call["error"]:
            g.record("find-free-port", False, f"find_free_port() raised {call['error']} ({which})")
            return
        if call["type"] != "int":
            hint = ""
            if call["type"] == "str":
                hint = (": a str works only where it goes into os.environ; socket.bind(('127.0.0.1', port)) "
                        "and TCPStore(port=...) need an int")
            g.record("find-free-port", False, f"find_free_port() returned {call['value']}, a {call['type']}, "
                     f"not an int{hint}")
            return
        port = int(call["value"])
        if not 0 < port < 65536:
            g.record("find-free-port", False, f"find_free_port() returned {port}, which is not a TCP port "
                     "number (1 to 65535)")
            return
        if call["bind_error"]:
            g.record("find-free-port", False, f"find_free_port() returned {port}, but right after the call a "
                     f"socket could not bind 127.0.0.1:{port} ({call['bind_error']}): the port is in use "
                     f"({which})")
            return
    g.record("find-free-port", True)


def _meeting_problem(launch: dict, caller_pid: int, world_size: int) -> str | None:
    """Why the ranks of one launch did not form their own group, or None."""
    launch_id = None
    for r in launch["records"]:
        if r["pid"] == caller_pid:
            continue  # spawns-processes says so
        rank = r["received"][0] if r["received"] else None
        if r["group_error"]:
            return f"rank {rank} could not join the group: {r['group_error']}"
        members = sorted(tuple(p) for p in r["peers"])
        launch_id = members[0][0] if launch_id is None else launch_id
        if {m[0] for m in members} != {launch_id} or [m[1] for m in members] != list(range(world_size)):
            met = ", ".join(f"rank {m[1]} of caller {m[0] - 1}" for m in members)
            return f"rank {rank}'s group was {{{met}}}: it met processes of the other launch"
    if launch["error"]:
        return f"launch_distributed raised {launch['error']}"
    return None


def check_raises(g, launch: dict, world_size: int) -> None:
    last = world_size - 1
    ranks = sorted(str(r["received"][0]) for r in launch["records"] if r["received"])
    if str(last) not in ranks:
        g.record("raises-on-failure", False, f"the launch of a fn that raises in rank {last} never ran rank "
                 f"{last} (ranks that ran: {', '.join(ranks) or 'none'}){_raised(launch)}", world_size=world_size)
    elif launch["error"] is None:
        g.record("raises-on-failure", False, f"rank {last} raised RuntimeError, but launch_distributed returned "
                 "normally: the caller never learns that the job failed", world_size=world_size)
    else:
        g.record("raises-on-failure", True)


def check_preset(g, launch: dict, preset_port, world_size: int) -> None:
    for r in launch["records"]:
        rank = r["received"][0] if r["received"] else None
        seen, wanted = (r["master_addr"], r["master_port"]), (PRESET_ADDR, str(preset_port))
        if seen != wanted:
            g.record("keeps-set-port", False,
                     f"MASTER_ADDR={wanted[0]} and MASTER_PORT={wanted[1]} were set before the call, but "
                     f"rank {rank} saw MASTER_ADDR={seen[0]} MASTER_PORT={seen[1]}",
                     rank=rank if isinstance(rank, int) else None, world_size=world_size)
            return
    if not launch["records"]:
        g.record("keeps-set-port", False, f"no rank recorded anything{_raised(launch)}", world_size=world_size)
        return
    g.record("keeps-set-port", True)


def check_direct(g, direct: dict) -> None:
    env = ", ".join(f"{k}={v}" for k, v in DIRECT_ENV.items() if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    expected = [int(DIRECT_ENV["RANK"]), int(DIRECT_ENV["WORLD_SIZE"])]
    if direct["error"]:
        g.record("rank-from-RANK", False, f"with {env}, launch_from_env raised {direct['error']}; it should "
                 "call fn(rank, world_size) once, in the process it runs in")
    elif direct["calls"] != [expected]:
        got = ", ".join(f"fn{_args(c)}" for c in direct["calls"]) or "fn was never called"
        g.record("rank-from-RANK", False, f"with {env}, launch_from_env called {got}; expected fn{_args(expected)}")
    else:
        g.record("rank-from-RANK", True)


def check_torchrun(g, run: dict, world_size: int) -> None:
    where = f"torchrun --standalone --nproc_per_node={world_size}"
    tail = "\n".join(run["output"].rstrip().splitlines()[-6:])
    if run["errors"]:
        g.record("torchrun", False, f"under {where}, launch_from_env raised: {run['errors'][0].strip()}",
                 world_size=world_size)
        return
    if run["returncode"] is None:
        g.record("torchrun", False, f"{where} did not finish within {run['timeout_s']:g} s", world_size=world_size)
        return
    records = run["records"]
    calls = sorted((r["received"] for r in records), key=str)
    expected = [[rank, world_size] for rank in range(world_size)]
    if calls != expected:
        got = ", ".join(f"fn{_args(c)}" for c in calls) or "nothing"
        g.record("torchrun", False, f"under {where}, fn was called as {got}; expected "
                 + ", ".join(f"fn{_args(c)}" for c in expected) + " (one call per torchrun process)",
                 world_size=world_size)
        return
    for r in records:
        if r["received"][0] != int(r["env_rank"]):
            g.record("torchrun", False, f"the torchrun process with RANK={r['env_rank']} called "
                     f"fn{_args(r['received'])}", world_size=world_size)
            return
    if run["returncode"] != 0:
        g.record("torchrun", False, f"{where} exited with code {run['returncode']}:\n{tail}", world_size=world_size)
        return
    g.record("torchrun", True)
