"""Exercise 15, the grader's ranks: the drivers ``alone_main`` (main() as the only worker, in the warm
pool) and ``jobs_main`` (both torchrun jobs at once), and the supervision of torchrun's agents: start,
wait, stop whatever is left (see :mod:`grader.checks.ex15_elastic` for the whole exercise and the verdicts).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

from grader.checks import ex15_worker
from grader.checks.ex15_worker import (ALONE_KILL, ENV_EVENTS, ENV_JOB, ENV_KILL, ENV_NODE, ENV_TAG, JOBS, SNAPSHOT,
                                       _run_main)

STOP_GRACE_S = 3.0  # an agent asked to stop (SIGTERM) gets this long to stop its workers
LINGER_S = 20.0  # an agent still running this long after its job's last worker ended is stopped
WORKER_SCRIPT = os.path.abspath(ex15_worker.__file__)  # what torchrun starts in each worker


# --- in the grader's ranks ---------------------------------------------------------------------


def alone_main(ctx) -> dict:
    """main() as the only worker, in the warm pool, with the environment torchrun gives one worker.

    The process group meets at the store the grader holds for this run. ``attempt`` 0 is killed as
    its snapshot of epoch KILL_EPOCH reaches the path; attempt 1 is the job launched again from
    scratch on the same folder (TORCHELASTIC_RESTART_COUNT=0, as after a scheduler's requeue).
    """
    attempt = ctx.kwargs["attempt"]
    # Attempt 1 is a new job on the old folder, not a restart torchrun counted: the count is 0.
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                       "TORCHELASTIC_RESTART_COUNT": "0"})
    folder = ctx.kwargs.get("folder") or os.path.join(ctx.run_dir, "alone")
    for sub in ("events", "snapshot"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    snapshot = os.path.join(folder, "snapshot", SNAPSHOT)

    def import_learner(path):
        return ctx.learner()  # the harness's import: an import error is reported as one

    _run_main(ctx.learner_path, ["--snapshot", snapshot], os.path.join(folder, "events"), "alone", attempt,
              ALONE_KILL, import_learner, restart_count="0")
    return {}


# --- in the grader's rank: start the agents, wait, stop whatever is left ----------------------


def jobs_main(ctx) -> dict:
    """Start both jobs' agents at once and wait for them, under this rank's deadline."""
    deadline = time.monotonic() + max(5.0, ctx.timeout_s - 6.0)
    port = os.environ["DDP_GRADE_RENDEZVOUS_PORT"]  # the store the grader holds for this run
    tag = ctx.kwargs["tag"]
    agents = []
    for index, (name, job) in enumerate(JOBS.items()):
        folder = os.path.join(ctx.run_dir, f"job{index}")
        for sub in ("events", "snapshot"):
            os.makedirs(os.path.join(folder, sub))
        for node_index, node in enumerate(job["nodes"]):
            agents.append(_start_agent(ctx, name, job, node, node_index, folder, port, f"ddp-grade-{index}", tag))
    started = time.monotonic()
    _wait_for_agents(agents, deadline)
    timed_out = [a for a in agents if a["returncode"] is None]
    for agent in timed_out:
        _stop(agent["process"])
    for agent in agents:
        agent["log"].close()
    left = _stop_tagged(tag)
    out = {"jobs": {}, "started": started, "timeout_s": deadline - started, "left_running": left}
    for agent in agents:
        job = out["jobs"].setdefault(agent["job"], {"folder": agent["folder"], "agents": {}})
        with open(agent["log_path"], "rb") as f:
            log = f.read().decode("utf-8", errors="replace")
        job["agents"][agent["node"]] = {"returncode": agent["returncode"], "command": agent["command"],
                                        "log": _tail(log, 4000), "lingered_s": agent.get("lingered_s")}
    return out


def _tail(text: str, limit: int) -> str:
    """The last whole lines of ``text``, within ``limit`` characters."""
    return text if len(text) <= limit else text[-limit:].split("\n", 1)[-1]


def _wait_for_agents(agents: list[dict], deadline: float) -> None:
    """Wait for every agent to exit, until the deadline; set each one's "returncode" (None: still running).

    A job whose restart has been used and whose workers have all ended can only exit now. An agent
    still running LINGER_S after that waits for something that will not come (torchrun's exit
    barrier waits 300 s for a node whose agent failed): it is left running, marked with
    "lingered_s", for the caller to stop, instead of holding the grading until its deadline.
    """
    ended_since: dict[str, float] = {}
    while True:
        waiting = [a for a in agents if a.get("returncode") is None and "lingered_s" not in a]
        for agent in waiting:
            agent["returncode"] = agent["process"].poll()
        waiting = [a for a in waiting if a["returncode"] is None]
        now = time.monotonic()
        if not waiting or now >= deadline:
            return
        for folder in {a["folder"] for a in waiting}:
            if not _job_over(folder):
                ended_since.pop(folder, None)
            elif now - ended_since.setdefault(folder, now) >= LINGER_S:
                for agent in waiting:
                    if agent["folder"] == folder:
                        agent["lingered_s"] = now - ended_since[folder]
        time.sleep(0.5)


def _job_over(folder: str) -> bool:
    """The job has restarted once (torchrun's --max-restarts 1) and none of its workers is running.

    Polled while the jobs run, so it reads only what it needs: the start markers that
    ``_attempt`` leaves, and the first line (the start event, with the pid) of each event file.
    """
    events = os.path.join(folder, "events")
    if not glob.glob(os.path.join(events, ".start-*-1")):
        return False
    return not any(_alive(_start_pid(path)) for path in glob.glob(os.path.join(events, "events-*.jsonl")))


def _start_pid(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.loads(f.readline()).get("pid")
    except (OSError, ValueError, AttributeError):
        return None


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] not in (b"Z", b"X")
    except (OSError, TypeError, ValueError, IndexError):
        return False


def _start_agent(ctx, name: str, job: dict, node: str, node_index: int, folder: str, port: str, run_id: str,
                 tag: str) -> dict:
    kit = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "PET_")) and k not in
           ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
    env.update({
        ENV_EVENTS: os.path.join(folder, "events"), ENV_JOB: name, ENV_NODE: node, ENV_TAG: tag,
        ENV_KILL: json.dumps(job["kill"]),
        "OMP_NUM_THREADS": "1",  # what torchrun would set, without its warning
        # torch 2.13's agent shares its rendezvous store with the workers and keeps it across
        # restarts: restarted workers then read the first attempt's keys and cannot form a group
        # (pytorch/pytorch#135712). Off, every attempt's rank 0 worker hosts a fresh store.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONPATH": os.pathsep.join([kit] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    })
    if ctx.backend == "nccl":  # one GPU per local rank; the two "nodes" share this machine's GPUs
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node_index * job["nproc"] + i) for i in range(job["nproc"]))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "torch.distributed.run",
               "--nnodes", str(len(job["nodes"])), "--nproc-per-node", str(job["nproc"]),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
               "--max-restarts", "1", "--local-addr", "127.0.0.1",
               WORKER_SCRIPT, ctx.learner_path, "--snapshot", os.path.join(folder, "snapshot", SNAPSHOT)]
    log_path = os.path.join(folder, f"agent-{node}.log")
    log = open(log_path, "wb")
    # Its own process group, so that it can be stopped with everything it started but its workers
    # (torchrun puts each in a session of its own; _stop_tagged finds those).
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    shown = ["torchrun"] + command[3:command.index(WORKER_SCRIPT)] + ["15_elastic.py", "--snapshot", SNAPSHOT]
    return {"job": name, "node": node, "folder": folder, "process": process, "log": log, "log_path": log_path,
            "command": " ".join(shown)}


def _stop(process) -> None:
    """SIGTERM to the agent's group (torchrun then stops its workers), SIGKILL after a grace."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(process.pid, sig)
        except OSError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _stop_tagged(tag: str) -> int:
    """Kill every process left that carries this grading's tag (a worker whose agent is gone)."""
    from grader import harness

    return harness.reap_strays(tag, variable=ENV_TAG)

