"""Exercise 15: main() of a fault-tolerant training script, under a real torchrun.

The grader runs the learner's script as a user would, under ``python -m torch.distributed.run``,
twice at once, in one rank of its own (so its deadline and its killing of whole process groups
cover every agent and worker):

* "2 nodes x 2": two torchrun agents on this machine stand in for two nodes (``--nnodes 2
  --nproc-per-node 2 --rdzv-backend c10d --max-restarts 1``), joined at the rendezvous store the
  grader holds for the run (its port is never given up, so nothing else can take it). In the
  first attempt the worker with RANK 3 is killed (SIGKILL) in the middle of an epoch.
* "1 node x 4": one agent, ``--nnodes 1 --nproc-per-node 4``, the same script unchanged and
  uninterrupted.

Before them, in the warm pool, main() as the only worker ("1 worker, relaunched"): killed at the
moment its snapshot of epoch KILL_EPOCH reaches the path (half-way through writing the path itself,
or just before renaming a finished file onto it), then launched again from scratch on the same
folder with TORCHELASTIC_RESTART_COUNT=0, as a scheduler that requeues the job would.

No verdict depends on timing: the kills are placed by counting optimizer steps and file
operations, every restarted torchrun worker sees the same TORCHELASTIC_RESTART_COUNT (the
attempt's number; torchrun's own value on the node whose worker did not die depends on when its
agent noticed), and the relaunch runs one worker alone.

torchrun starts this very file in each worker (``worker_entry``, below): it installs the probes,
imports the learner's file and calls its ``main()``. The probes write what they see to files at
once, one JSON line per event, so that a worker killed without warning leaves its record: the
environment torchrun gave it, the snapshot as it found it, every sampler order, every training
batch and optimizer step, every file written near the snapshot, every torch.load, the kill.

The grader reads those files, rebuilds the timeline (per node and rank: epochs, kill, restart,
epoch resumed from), trains the same model uninterrupted in its own process, and decides.
"""

from __future__ import annotations

import glob
import io
import json
import linecache
import os
import re
import signal
import subprocess
import sys
import time

import torch
from torch import nn

# The exercise's constants and helpers: the same as in the statement (the uninterrupted run uses these).
EPOCHS = 4
BATCH_SIZE = 4
NUM_SAMPLES = 48
LR = 0.05
MOMENTUM = 0.9
SEED = 15
WORLD_SIZE = 4
STEPS_PER_EPOCH = NUM_SAMPLES // (WORLD_SIZE * BATCH_SIZE)
SNAPSHOT = "snapshot.pt"
TOLERANCE = 1e-5

# The torchrun jobs, run at the same time: how torchrun is started, and what the grader does to the
# first attempt. Both kills happen in (or at the end of) epoch KILL_EPOCH; the snapshot of
# KILL_EPOCH - 1 is then the last complete one, and the run resumes at RESUME_EPOCH.
KILL_EPOCH = 2
RESUME_EPOCH = KILL_EPOCH
JOBS = {
    "2 nodes x 2": {"nodes": ("a", "b"), "nproc": 2,
                    # RANK 3, after its second optimizer step of epoch KILL_EPOCH: mid-epoch
                    "kill": {"rank": 3, "after_step": KILL_EPOCH * STEPS_PER_EPOCH + 2}},
    "1 node x 4": {"nodes": ("a",), "nproc": 4, "kill": {}},  # the same script, unchanged, uninterrupted
}
# Before them, main() as a single worker in the warm pool, twice: killed as the snapshot of epoch
# KILL_EPOCH reaches the path, then launched again from scratch on the same folder, with
# TORCHELASTIC_RESTART_COUNT=0 (a scheduler's requeue of the whole job, without torchrun's cost).
ALONE = "1 worker, relaunched"
ALONE_STEPS_PER_EPOCH = NUM_SAMPLES // BATCH_SIZE
ALONE_KILL = {"rank": 0, "write_after_step": (KILL_EPOCH + 1) * ALONE_STEPS_PER_EPOCH}
# Why the grader killed a worker (the "killed" event), and so how its kill is judged.
KILLED_MID_EPOCH = "mid-epoch"
KILLED_WRITING = "while writing onto the snapshot path"
KILLED_BEFORE_RENAME = "just before renaming the new snapshot onto the path"

# Handed from the grader's rank to the agents, and from them to every worker.
ENV_EVENTS = "DDP_GRADE_EX15_EVENTS"  # the folder of event files
ENV_JOB = "DDP_GRADE_EX15_JOB"  # the job's name
ENV_NODE = "DDP_GRADE_EX15_NODE"  # which agent ("a" or "b")
ENV_KILL = "DDP_GRADE_EX15_KILL"  # the kill plan, JSON
ENV_TAG = "DDP_GRADE_EX15_TAG"  # a value only this grading's processes carry
STOP_GRACE_S = 3.0  # an agent asked to stop (SIGTERM) gets this long to stop its workers
LINGER_S = 20.0  # an agent still running this long after its job's last worker ended is stopped


def build_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def build_dataset():
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = torch.randint(0, 4, (NUM_SAMPLES,), generator=g)
    return TensorDataset(x, y)


# --- in every worker torchrun starts ----------------------------------------------------


class _Recorder:
    """One JSON line per event, written at once: a worker killed with SIGKILL keeps its record."""

    def __init__(self, folder: str, name: str):
        self.file = open(os.path.join(folder, name), "a", buffering=1)
        self.steps = 0
        self.epoch = None  # sampler.epoch of the latest sampler iteration

    def event(self, kind: str, **data) -> None:
        data.update(e=kind, t=time.monotonic())
        self.file.write(json.dumps(data) + "\n")
        self.file.flush()


def _attempt(folder: str, node: str, local_rank: str) -> int:
    """How many times this node's worker of this local rank has started before (one at a time)."""
    attempt = 0
    while True:
        try:
            os.close(os.open(os.path.join(folder, f".start-{node}-{local_rank}-{attempt}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return attempt
        except FileExistsError:
            attempt += 1


def worker_entry() -> None:
    """``python ex15_elastic.py LEARNER_FILE [the script's own arguments]``, started by torchrun."""
    learner_path, script_args = sys.argv[1], sys.argv[2:]
    folder, node = os.environ[ENV_EVENTS], os.environ[ENV_NODE]
    attempt = _attempt(folder, node, os.environ.get("LOCAL_RANK", "x"))
    plan = json.loads(os.environ.get(ENV_KILL) or "{}")
    try:
        # Every worker of attempt N sees TORCHELASTIC_RESTART_COUNT=N: torchrun's agent of the node
        # whose worker died says 1 after the restart, the other agent 0 or 1, depending on whether
        # it noticed the failure before the group's membership changed. A script that reads it
        # would pass one grading and fail the next; the relaunch (alone_main) tests 0 on purpose.
        _run_main(learner_path, script_args, folder, node, attempt, plan, restart_count=str(attempt))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)  # the record is complete: skip seconds of interpreter teardown


def _run_main(learner_path: str, script_args: list[str], folder: str, node: str, attempt: int, plan: dict,
              import_learner=None, restart_count: str | None = None) -> None:
    """The learner's main() with the probes installed; its model's parameters saved when it returns.

    ``restart_count``: the TORCHELASTIC_RESTART_COUNT main() sees (the start event keeps the
    environment as it was given, and this value as ``restart_count``).
    """
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                          "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")}
    if restart_count is not None:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = restart_count
    name = f"{node}-{attempt}-{env['LOCAL_RANK']}"
    rec = _Recorder(folder, f"events-{name}.jsonl")
    rec.event("start", pid=os.getpid(), node=node, attempt=attempt, env=env,
              restart_count=os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    snapshot_path = _snapshot_argument(script_args)
    rec.event("snapshot-found", **_peek(snapshot_path))
    armed = attempt == 0 and plan.get("rank") is not None and str(plan["rank"]) == env["RANK"]
    models: list = []
    _install_probes(rec, plan if armed else {}, snapshot_path, models, learner_path)
    sys.argv = [learner_path, *script_args]
    try:
        if import_learner is None:
            from grader.child import import_learner
        module = import_learner(learner_path)
        _wrap_build_model(module, rec, models)
        if not hasattr(module, "main"):
            raise AttributeError(f"{os.path.basename(learner_path)} defines no main()")
        module.main()
    except BaseException as exc:
        rec.event("error", error=_error_text(exc)[:600])
        raise
    rec.event("end", steps=rec.steps)
    if models:
        _real_save({k: v.detach().to("cpu", copy=True) for k, v in models[-1].state_dict().items()},
                   os.path.join(folder, f"final-{name}.pt"))


_real_save = torch.save
_real_load = torch.load


def _snapshot_argument(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--snapshot" and i + 1 < len(args):
            return os.path.abspath(args[i + 1])
        if arg.startswith("--snapshot="):
            return os.path.abspath(arg.split("=", 1)[1])
    return None


def _peek(path: str | None) -> dict:
    """The snapshot as this worker finds it at start, read the way the grader reads files."""
    if not path or not os.path.exists(path):
        return {"exists": False}
    try:
        with open(path, "rb") as f:
            data = f.read()
        obj = _real_load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        return {"exists": True, "size": os.path.getsize(path), "error": _error_text(exc)[:300]}
    return {"exists": True, "size": len(data), **_contents(obj)}


def _error_text(exc: BaseException) -> str:
    """``Type: message``, or the type alone when the message is empty (an EOFError of an empty file)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (no message)"


def _contents(obj) -> dict:
    """What the grader notes of a loaded snapshot: its integer "epoch" (or None), its top-level keys."""
    epoch = obj.get("epoch") if isinstance(obj, dict) else None
    keys = sorted(str(k) for k in obj)[:12] if isinstance(obj, dict) else None
    return {"epoch": epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None, "keys": keys,
            "type": type(obj).__name__}


def _without_comment(line: str) -> str:
    """One line of source without its trailing comment (the learner's words are not the grader's)."""
    import tokenize

    try:
        for token in tokenize.generate_tokens(io.StringIO(line).readline):
            if token.type == tokenize.COMMENT:
                return line[:token.start[1]].strip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return line.strip()


def _kill_self(rec: _Recorder, why: str, **data) -> None:
    rec.event("killed", why=why, steps=rec.steps, epoch=rec.epoch, **data)
    os.kill(os.getpid(), signal.SIGKILL)


def _install_probes(rec: _Recorder, plan: dict, snapshot_path: str | None, models: list,
                    learner_path: str | None = None) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data import DistributedSampler

    real_iter, real_set_epoch = DistributedSampler.__iter__, DistributedSampler.set_epoch

    def iterate(sampler):
        order = [int(i) for i in real_iter(sampler)]
        rec.epoch = int(sampler.epoch)
        rec.event("iter", epoch=int(sampler.epoch), rank=int(sampler.rank), num_replicas=int(sampler.num_replicas),
                  shuffle=bool(sampler.shuffle), seed=int(sampler.seed), order=order)
        return iter(order)

    def set_epoch(sampler, epoch):
        rec.event("set_epoch", epoch=int(epoch) if isinstance(epoch, int) else repr(epoch)[:40])
        return real_set_epoch(sampler, epoch)

    DistributedSampler.__iter__ = iterate
    DistributedSampler.set_epoch = set_epoch

    def after_step(optimizer, args, kwargs):
        rec.steps += 1
        rec.event("step", n=rec.steps)
        if plan.get("after_step") == rec.steps:
            _kill_self(rec, KILLED_MID_EPOCH)

    register_optimizer_step_post_hook(after_step)

    def load(f, *args, **kwargs):
        where = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        where = os.path.abspath(where) if isinstance(where, str) else None
        try:
            result = _real_load(f, *args, **kwargs)
        except Exception as exc:
            rec.event("load", path=where, error=_error_text(exc)[:300])
            raise
        rec.event("load", path=where, **_contents(result))
        return result

    torch.load = torch.serialization.load = load
    if snapshot_path is None:
        return
    inside = os.path.join(os.path.dirname(snapshot_path), "")
    writing_kill = plan.get("write_after_step")
    learner_file = os.path.abspath(learner_path) if learner_path else None

    busy = []  # set while the probes themselves open files

    def armed() -> bool:
        return writing_kill is not None and rec.steps >= writing_kill

    def where() -> dict:
        """The learner's line that led to this write, for a message to point at."""
        frame = sys._getframe(1)
        while frame is not None:
            if learner_file and os.path.abspath(frame.f_code.co_filename) == learner_file:
                code = _without_comment(linecache.getline(learner_file, frame.f_lineno))
                return {"line": frame.f_lineno, "code": code[:120]}
            frame = frame.f_back
        return {}

    # The kill of the plan's "write_after_step" lands where the new snapshot reaches the path, and
    # nowhere else: on a write to the path itself (half of the bytes, or none, reach it), or just
    # before a file is renamed onto it. Files beside it (a temporary file, a backup, a log) are
    # written in full: the path is what a restarted worker reads.

    def save(obj, f, *args, **kwargs):
        path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        path = os.path.abspath(path) if isinstance(path, str) else None
        if path is not None and path.startswith(inside):
            direct = path == snapshot_path
            busy.append(1)
            rec.event("write", op="torch.save", path=path, **(where() if direct else {}))
            busy.pop()
            if direct and armed():
                # Half of the bytes reach the path, then the worker dies: a torn write.
                buffer = io.BytesIO()
                _real_save(obj, buffer, *args, **kwargs)
                data = buffer.getvalue()
                busy.append(1)
                target = open(path, "wb") if isinstance(f, (str, os.PathLike)) else f
                target.write(data[:len(data) // 2])
                target.flush()
                _kill_self(rec, KILLED_WRITING, op="torch.save")
        return _real_save(obj, f, *args, **kwargs)

    torch.save = torch.serialization.save = save

    def audit(event: str, args: tuple) -> None:
        if busy or event not in ("open", "os.rename"):
            return
        busy.append(1)
        try:
            if event == "open":
                path, mode, flags = args[0], args[1], args[2]
                if not isinstance(path, (str, bytes, os.PathLike)):
                    return
                path = os.path.abspath(os.fsdecode(path))
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                    bool(isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT))
                if not writing or not path.startswith(inside):
                    return
                direct = path == snapshot_path
                rec.event("write", op="open", path=path, **(where() if direct else {}))
                if direct and armed():
                    truncating = (isinstance(mode, str) and "w" in mode) or \
                        bool(isinstance(flags, int) and flags & os.O_TRUNC)
                    if truncating:  # what this open was about to do, then the worker dies before writing
                        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
                    _kill_self(rec, KILLED_WRITING, op="open")
            elif event == "os.rename":
                src, dst = (os.path.abspath(os.fsdecode(a)) for a in args[:2])
                if dst.startswith(inside) or src.startswith(inside):
                    rec.event("write", op="rename", src=src, path=dst)
                    if dst == snapshot_path and armed():
                        _kill_self(rec, KILLED_BEFORE_RENAME, op="rename")
        except Exception:  # never fail the learner's own call
            return
        finally:
            busy.clear()
    sys.addaudithook(audit)


def _wrap_build_model(module, rec: _Recorder, models: list) -> None:
    """The learner's build_model, its model's training inputs logged as dataset indices."""
    build = getattr(module, "build_model", None)
    if build is None:
        return
    dataset = build_dataset()
    index_of = {row.numpy().tobytes(): i for i, row in enumerate(dataset.tensors[0])}

    def logged_build_model(*args, **kwargs):
        model = build(*args, **kwargs)

        def log_forward(_module, inputs):
            if not torch.is_grad_enabled() or not inputs or not isinstance(inputs[0], torch.Tensor):
                return
            x = inputs[0].detach().to("cpu")
            rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
            device = str(inputs[0].device)
            current = torch.cuda.current_device() if inputs[0].is_cuda else None
            rec.event("forward", indices=[index_of.get(r.numpy().tobytes(), -1) for r in rows],
                      device=device, cuda_current=current)

        model.register_forward_pre_hook(log_forward)
        models.append(model)
        return model

    module.build_model = logged_build_model


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
               os.path.abspath(__file__), ctx.learner_path, "--snapshot", os.path.join(folder, "snapshot", SNAPSHOT)]
    log_path = os.path.join(folder, f"agent-{node}.log")
    log = open(log_path, "wb")
    # Its own process group, so that it can be stopped with everything it started but its workers
    # (torchrun puts each in a session of its own; _stop_tagged finds those).
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    shown = ["torchrun"] + command[3:command.index(os.path.abspath(__file__))] + ["15_elastic.py", "--snapshot",
                                                                                    SNAPSHOT]
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


# --- in the grader: read the records --------------------------------------------------------


def _read_lines(path: str) -> list[dict]:
    """The events of one worker; a line cut short by a kill is skipped."""
    out = []
    try:
        with open(path, "rb") as f:
            for line in f.read().decode("utf-8", errors="replace").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and isinstance(event.get("e"), str):
                    out.append(event)
    except OSError:
        pass
    return out


def read_workers(folder: str) -> list[dict]:
    """Every worker start of one job, from its event file, summed up."""
    workers = []
    for path in sorted(glob.glob(os.path.join(folder, "events", "events-*.jsonl"))):
        events = _read_lines(path)
        start = next((e for e in events if e["e"] == "start"), None)
        if start is None:
            continue
        env = start.get("env") or {}
        name = os.path.basename(path)[len("events-"):-len(".jsonl")]
        worker = {
            "node": str(start.get("node")), "attempt": int(start.get("attempt", 0)), "pid": start.get("pid"),
            "rank": _int(env.get("RANK")), "local_rank": _int(env.get("LOCAL_RANK")),
            "world_size": _int(env.get("WORLD_SIZE")), "group_rank": _int(env.get("GROUP_RANK")),
            # what main() saw (the grader sets it), and what torchrun had set
            "restart_count": _int(start.get("restart_count", env.get("TORCHELASTIC_RESTART_COUNT"))),
            "torchrun_restart_count": _int(env.get("TORCHELASTIC_RESTART_COUNT")),
            "start": start["t"], "end": events[-1]["t"],
            "found": next((e for e in events if e["e"] == "snapshot-found"), {}),
            "loads": [e for e in events if e["e"] == "load"],
            "writes": [e for e in events if e["e"] == "write"],
            "set_epoch": [e.get("epoch") for e in events if e["e"] == "set_epoch"],
            "killed": next((e for e in events if e["e"] == "killed"), None),
            "error": next((e.get("error") for e in events if e["e"] == "error"), None),
            "finished": any(e["e"] == "end" for e in events),
            "steps": sum(1 for e in events if e["e"] == "step"),
            "devices": sorted({(e.get("device"), e.get("cuda_current")) for e in events if e["e"] == "forward"},
                              key=str),
            "final": os.path.join(folder, "events", f"final-{name}.pt"),
        }
        worker.update(_training(events))
        workers.append(worker)
    return workers


def _int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _training(events: list[dict]) -> dict:
    """The batches that fed optimizer steps, grouped by the sampler iteration each came from.

    Returns ``epochs``: one entry per sampler iteration that fed a step, in order:
    ``{"epoch": sampler.epoch, "rank": ..., "num_replicas": ..., "indices": [...], "steps": n}``.
    """
    iterations: list[dict] = []
    epochs: list[dict] = []
    last_forward = None
    for e in events:
        if e["e"] == "iter":
            iterations.append(e)
        elif e["e"] == "forward":
            last_forward = (e.get("indices") or [], len(iterations) - 1)
        elif e["e"] == "step" and last_forward is not None:
            indices, index = last_forward
            last_forward = None
            if not epochs or epochs[-1]["iteration"] != index:
                source = iterations[index] if index >= 0 else {}
                epochs.append({"iteration": index, "epoch": source.get("epoch"), "rank": source.get("rank"),
                               "num_replicas": source.get("num_replicas"), "seed": source.get("seed"),
                               "shuffle": source.get("shuffle"), "indices": [], "steps": 0})
            epochs[-1]["indices"].extend(int(i) for i in indices)
            epochs[-1]["steps"] += 1
    return {"epochs": epochs}


def _who(w: dict) -> str:
    if w["node"] == "alone":
        return f"RANK {w['rank']} (the only worker)"
    return f"RANK {w['rank']} (node {w['node']}, LOCAL_RANK {w['local_rank']})"


def _read_final(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            state = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    except (OSError, Exception):
        return None
    return state if isinstance(state, dict) else None


# --- in the grader: the run nobody interrupted -----------------------------------------------


def uninterrupted(world_size: int) -> dict:
    """EPOCHS epochs of the exercise's training on ``world_size`` ranks, without a failure, in one process.

    Each step: the mean over ranks of each rank's mean loss on its batch (what DDP's averaged
    gradients are the gradient of), then SGD with momentum, written out (torch.optim would import
    torch._dynamo here).
    """
    from torch.utils.data import DistributedSampler

    with torch.random.fork_rng():
        model = build_model()
    dataset = build_dataset()
    x_all, y_all = dataset.tensors
    buffers: dict = {}
    for epoch in range(EPOCHS):
        orders = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for step in range(NUM_SAMPLES // (world_size * BATCH_SIZE)):
            model.zero_grad()
            losses = []
            for order in orders:
                idx = torch.tensor(order[step * BATCH_SIZE:(step + 1) * BATCH_SIZE])
                losses.append(nn.functional.cross_entropy(model(x_all[idx]), y_all[idx]))
            (sum(losses) / world_size).backward()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    buf = buffers.get(name)
                    buf = p.grad.clone() if buf is None else buf.mul_(MOMENTUM).add_(p.grad)
                    buffers[name] = buf
                    p.add_(buf, alpha=-LR)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- in the grader: the checks ------------------------------------------------------------------


def grade(g) -> None:
    import uuid

    alone = run_alone(g)
    outcome = g.run("jobs_main", 1, kwargs={"tag": uuid.uuid4().hex},
                    label="torchrun: 2 nodes x 2 (a worker killed mid-epoch) and 1 node x 4", graded_size=WORLD_SIZE)
    info = outcome.results()[0]
    jobs = {ALONE: alone}
    for name, job in info["jobs"].items():
        jobs[name] = {**job, "workers": read_workers(job["folder"]), "world": WORLD_SIZE, "plan": JOBS[name]["kill"]}
    g.add_timeline(timeline(jobs))
    timed_out = [(name, node) for name, job in jobs.items() for node, a in job["agents"].items()
                 if a["returncode"] is None and a.get("lingered_s") is None]
    if timed_out:
        g.stop(_timeout_message(jobs, timed_out, info["timeout_s"]), status="timeout")
    references = {}
    for name, job in jobs.items():
        reference = references.setdefault(job["world"], uninterrupted(job["world"]))
        if job["agents"]:
            check_exit(g, name, job)
            check_devices(g, name, job)
        check_writers(g, name, job)
        check_shards(g, name, job)
        check_set_epoch(g, name, job)
        check_final(g, name, job, reference)
        check_snapshot(g, name, job)
    # torchrun's restart first: a relaunch that does not resume is then told whether the restart did
    restart_resumed = None
    for name, job in jobs.items():
        if job["plan"] and name != ALONE:
            restart_resumed = check_resume(g, name, job)
    check_resume(g, ALONE, alone, restart_resumed=restart_resumed)
    check_atomic(g, jobs)


def run_alone(g) -> dict:
    """main() as one worker, killed as its snapshot reaches the path, then the job launched again."""
    first = g.run("alone_main", 1, kwargs={"attempt": 0}, expect_ok=False, graded_size=1,
                  label=f"main() as one worker, killed as its snapshot of epoch {KILL_EPOCH} reaches the path")
    folder = os.path.join(first.run_dir, "alone")
    workers = read_workers(folder)
    if not any(w["killed"] for w in workers):
        g.stop_on_failures(first)  # the learner's own error (not implemented, an exception), with its line
    g.run("alone_main", 1, kwargs={"attempt": 1, "folder": folder}, expect_ok=False, graded_size=1,
          label="main() launched again from scratch on that snapshot (TORCHELASTIC_RESTART_COUNT=0)")
    return {"folder": folder, "workers": read_workers(folder), "agents": {}, "world": 1, "plan": ALONE_KILL}


def _timeout_message(jobs: dict, timed_out: list, timeout_s: float) -> str:
    lines = [f"torchrun had not finished after {timeout_s:.0f} s ("
             + ", ".join(f"{name}, node {node}" for name, node in timed_out) + "); the grader stopped it."]
    for name, node in timed_out:
        for w in jobs[name]["workers"]:
            if w["node"] == node and not w["finished"] and not w["killed"] and not w["error"]:
                lines.append(f"{name}: attempt {w['attempt']}, {_who(w)} had trained epochs "
                             f"{[e['epoch'] for e in w['epochs']]} ({w['steps']} steps) and was still running")
    return "\n".join(lines)


def _record(g, check_id: str, ok: bool, job: str, message: str = "", rank: int | None = None,
            world: int = WORLD_SIZE) -> bool:
    return g.record(check_id, ok, f"{job}: {message}", rank=rank, world_size=world)


def _last_line(log: str) -> str:
    lines = [ln for ln in log.strip().splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return _short_error((errors or lines or [""])[-1].strip())[:300]


def check_exit(g, name: str, job: dict) -> None:
    for node, agent in sorted(job["agents"].items()):
        code = agent["returncode"]
        if code is None and agent.get("lingered_s") is not None:
            _record(g, "job-exits-0", False, name, f"the torchrun agent of node {node} had not exited "
                    f"{agent['lingered_s']:.0f} s after the job's last worker ended (an agent waits at its exit for "
                    f"the other nodes), and the grader stopped it; its last words: "
                    f"{_last_line(agent['log'])}")
        elif code != 0:
            _record(g, "job-exits-0", False, name, f"the torchrun agent of node {node} exited with code {code}; "
                    f"its last words: {_last_line(agent['log'])}")
    g.record("job-exits-0", True)


def _exit_text(agent: dict) -> str:
    if agent["returncode"] is not None:
        return str(agent["returncode"])
    if agent.get("lingered_s") is not None:
        return f"no exit {agent['lingered_s']:.0f} s after the last worker ended (stopped by the grader)"
    return "no exit (stopped at the deadline)"


def _attempts(job: dict) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for w in job["workers"]:
        out.setdefault(w["attempt"], []).append(w)
    return out


def _snapshot_path(job: dict) -> str:
    return os.path.join(job["folder"], "snapshot", SNAPSHOT)


def _kill(job: dict) -> dict | None:
    return next((w for w in job["workers"] if w["killed"]), None)


def _steps_per_epoch(job: dict) -> int:
    return NUM_SAMPLES // (job["world"] * BATCH_SIZE)


def _why_no_kill(job: dict) -> str:
    plan = job["plan"]
    target = next((w for w in _attempts(job).get(0, []) if w["rank"] == plan["rank"]), None)
    if target is None:
        return f"no worker with RANK {plan['rank']} started"
    if "after_step" in plan:
        return (f"{_who(target)} took {target['steps']} optimizer step(s), never reaching step {plan['after_step']} "
                f"(epoch {KILL_EPOCH}, step 2 of {_steps_per_epoch(job)}), where the grader kills it")
    return (f"{_who(target)} took {target['steps']} optimizer step(s), and after step {plan['write_after_step']} "
            f"(the end of epoch {KILL_EPOCH}) it neither wrote {SNAPSHOT} (the --snapshot path) nor renamed a file "
            "onto it; the grader kills it there")


def _by_rank(workers: list[dict]) -> list[dict]:
    return sorted(workers, key=lambda w: (w["rank"] is None, w["rank"] if w["rank"] is not None else 0))


def check_resume(g, name: str, job: dict, restart_resumed: bool | None = None) -> bool:
    """After the kill every worker continues from the last complete snapshot: after torchrun's restart,
    and after the relaunch of the whole job (ALONE's attempt 1, TORCHELASTIC_RESTART_COUNT=0).

    ``restart_resumed``: for the relaunch, whether every worker resumed after torchrun's restart.
    Returns whether this job's workers resumed.
    """
    world, relaunch = job["world"], name == ALONE
    again = "after the relaunch" if relaunch else "after the restart"
    started = "when the job was launched again" if relaunch else "when the workers started again"
    if _kill(job) is None:
        return _record(g, "resumes-from-snapshot", False, name, f"the grader's kill never happened: "
                       f"{_why_no_kill(job)}", world=world)
    restarted = _attempts(job).get(1, [])
    if not restarted:
        return _record(g, "resumes-from-snapshot", False, name, "after the kill, the workers were never started "
                       "again", world=world)
    found = restarted[0]["found"]
    if not found.get("exists"):
        return _record(g, "resumes-from-snapshot", False, name, f"{started} there was no snapshot at --snapshot "
                       f"{SNAPSHOT}: nothing to resume from", world=world)
    if found.get("error"):
        return _record(g, "resumes-from-snapshot", False, name, f"{started}, the snapshot ({found.get('size')} "
                       f"bytes) could not be read: {_first_sentence(found['error'])}", world=world)
    saved = found.get("epoch")
    resume_at = saved + 1 if isinstance(saved, int) else None
    snapshot = _snapshot_words(found)
    path = os.path.abspath(_snapshot_path(job))
    loaded = {id(w): [ld for ld in w["loads"] if ld.get("path") == path] for w in restarted}
    resumed = [w for w in _by_rank(restarted) if any(not ld.get("error") for ld in loaded[id(w)])]
    for w in _by_rank(restarted):
        loads = loaded[id(w)]
        trained = [e["epoch"] for e in w["epochs"]]
        if not loads:
            if relaunch:
                message = (f"the job was launched again from scratch onto {snapshot} (TORCHELASTIC_RESTART_COUNT="
                           f"{w['restart_count']}, as when a scheduler requeues a job), and {_who(w)} never loaded "
                           f"it and trained {len(trained)} epoch(s) from the start")
                message += (", although after torchrun's restart (TORCHELASTIC_RESTART_COUNT=1) the workers did "
                            "resume: resume whenever the snapshot exists, whatever the restart count says"
                            if restart_resumed else f": load it whenever it exists and continue at epoch {resume_at}")
            else:
                message = (f"{again} {_who(w)} never loaded {snapshot} and trained {len(trained)} epoch(s) "
                           f"(sampler epochs {trained}), from the start")
                if resumed:
                    other = resumed[0]
                    began = other["epochs"][0]["epoch"] if other["epochs"] else None
                    message += (f", while {_who(other)} loaded it and began with epoch {began}: every worker "
                                "must load the snapshot, or they train different epochs side by side")
                else:
                    message += f": load it when it exists and continue at epoch {resume_at}"
            return _record(g, "resumes-from-snapshot", False, name, message, rank=w["rank"], world=world)
        failed = next((ld for ld in loads if ld.get("error")), None)
        if failed:
            return _record(g, "resumes-from-snapshot", False, name, f"{again} {_who(w)}'s torch.load of the "
                           f"snapshot raised {_first_sentence(failed['error'], 200)}", rank=w["rank"], world=world)
        # Resuming is loading and then beginning where the snapshot left off. A worker that did so and
        # then failed (a peer's crash, its own later mistake) resumed: job-exits-0 and
        # matches-uninterrupted judge the rest, so this verdict does not depend on when that failure came.
        if not trained and (resume_at is None or resume_at < EPOCHS):
            ended = f": main() ended with {_short_error(w['error'])}" if w["error"] else ""
            return _record(g, "resumes-from-snapshot", False, name, f"{again} {_who(w)} loaded {snapshot} but "
                           f"trained no epoch after it{ended}", rank=w["rank"], world=world)
        if resume_at is not None and trained and len(set(trained)) == len(trained) and trained[0] != resume_at:
            return _record(g, "resumes-from-snapshot", False, name,
                           f"{again} {_who(w)} loaded {snapshot} and began with epoch {trained[0]}, expected "
                           f"{resume_at} (the saved epoch + 1)", rank=w["rank"], world=world)
        if w["finished"] and resume_at is not None and len(trained) != EPOCHS - resume_at:
            return _record(g, "resumes-from-snapshot", False, name,
                           f"{again} {_who(w)} loaded {snapshot} but then trained {len(trained)} epoch(s) (sampler "
                           f"epochs {trained}); continuing at epoch {resume_at} leaves {EPOCHS - resume_at} of the "
                           f"{EPOCHS}", rank=w["rank"], world=world)
    return g.record("resumes-from-snapshot", True)


def _snapshot_words(found: dict) -> str:
    """The snapshot a worker found at start, in words."""
    if found.get("epoch") is not None:
        return f"the snapshot of epoch {found['epoch']}"
    keys = found.get("keys")
    held = f"its keys: {', '.join(keys)}" if keys is not None else f"a {found.get('type') or 'value'}, not a dict"
    return f"the snapshot (it holds no integer 'epoch'; {held})"


def check_atomic(g, jobs: dict) -> None:
    """At every moment the snapshot path holds a complete snapshot.

    Two observations. The relaunch after ALONE's kill, which lands where the new snapshot reaches the
    path (half-way through writing the path itself, or just before a file is renamed onto it), finds
    the previous snapshot whole. And no worker of any job writes the path itself: while such a write
    lasts the path holds part of a snapshot, whenever the worker dies.
    """
    alone = jobs[ALONE]
    path = os.path.abspath(_snapshot_path(alone))
    killed = _kill(alone)
    why = killed["killed"].get("why") if killed else None
    if why not in (KILLED_WRITING, KILLED_BEFORE_RENAME):
        _record(g, "snapshot-atomic", False, ALONE, f"the grader's kill never happened: {_why_no_kill(alone)}",
                world=alone["world"])
        return
    relaunched = _attempts(alone).get(1, [])
    found = relaunched[0]["found"] if relaunched else {}
    at = killed["killed"].get("epoch", KILL_EPOCH)  # the sampler's epoch at the kill: the one being saved
    when = f"{why} (the snapshot of epoch {at})"
    if why == KILLED_WRITING:
        direct = [r for r in killed["writes"] if r.get("path") == path and r.get("op") != "rename"]
        how = _direct_write_words(direct[-1]) if direct else f"a write onto {SNAPSHOT}"
        when = f"while it wrote the snapshot of epoch {at} onto {SNAPSHOT} itself ({how})"
    message = None
    if not relaunched:
        message = "the worker was not launched again after the kill"
    elif not found.get("exists") and len([r for r in killed["writes"] if r.get("path") == path]) <= 1:
        message = (f"{_who(killed)} was killed {when}, the first time anything reached {SNAPSHOT}: there was no "
                   f"earlier snapshot to resume from. Save one at the end of every epoch")
    elif not found.get("exists"):
        message = (f"{_who(killed)} was killed {when}, and the relaunched worker found no snapshot at all: the "
                   f"one of epoch {KILL_EPOCH - 1} was gone (removed or renamed away) before the new one was in "
                   "place. os.replace the new file onto the path, which swaps it in one step")
    elif found.get("error"):
        copied = killed["killed"].get("op") == "open"
        message = (f"{_who(killed)} was killed {when}, and the relaunched worker found a torn file at the path "
                   f"({found.get('size')} bytes that do not load: {_first_sentence(found['error'])}): the snapshot "
                   f"of epoch {KILL_EPOCH - 1} had been overwritten in place. Write the new snapshot to a temporary "
                   "file in the same folder, then os.replace it onto the path"
                   + (" (copying it onto the path, as shutil.copyfile does, writes the path in place too)"
                      if copied else ""))
    if message is not None:
        _record(g, "snapshot-atomic", False, ALONE, message, world=alone["world"])
        return
    for name, job in jobs.items():
        path = os.path.abspath(_snapshot_path(job))
        for w in sorted(job["workers"], key=lambda w: (w["attempt"], w["rank"] is None, w["rank"] or 0)):
            direct = [r for r in w["writes"] if r.get("path") == path and r.get("op") != "rename"]
            if direct:
                _record(g, "snapshot-atomic", False, name, f"attempt {w['attempt']}: {_who(w)} wrote {SNAPSHOT} "
                        f"itself ({_direct_write_words(direct[0])}): for as long as that write lasts the path "
                        "holds part of a snapshot, and a worker killed then leaves it torn. Write a temporary file "
                        "in the same folder and os.replace it onto the path", rank=w["rank"], world=job["world"])
                return
    g.record("snapshot-atomic", True)


def _direct_write_words(write: dict) -> str:
    """A write onto the snapshot path itself, in words, with the learner's line when known."""
    what = f"torch.save onto {SNAPSHOT}" if write.get("op") == "torch.save" else f"opened {SNAPSHOT} for writing"
    if write.get("line"):
        what += f", line {write['line']}" + (f": {write['code']}" if write.get("code") else "")
    return what


def check_writers(g, name: str, job: dict) -> None:
    from grader import probes

    path = os.path.abspath(_snapshot_path(job))
    workers = job["workers"]
    writers = probes.writers_of(path, [w["writes"] for w in workers])
    if not writers:
        _record(g, "rank0-writes-only", False, name, f"no worker wrote the snapshot ({SNAPSHOT}, given as "
                "--snapshot)", world=job["world"])
        return
    for index, records in sorted(writers.items()):
        w = workers[index]
        if w["rank"] != 0:
            how = "; ".join(sorted({probes.describe_write(r, path).replace("the checkpoint", "the snapshot")
                                    for r in records}))
            note = " (it is LOCAL_RANK 0 of another node: is the writer chosen by LOCAL_RANK?)" \
                if w["local_rank"] == 0 and w["group_rank"] not in (0, None) else ""
            _record(g, "rank0-writes-only", False, name, f"attempt {w['attempt']}: {_who(w)} wrote the snapshot "
                    f"({how}); only global rank 0 may write it{note}", rank=w["rank"], world=job["world"])
            return
    g.record("rank0-writes-only", True)


def check_shards(g, name: str, job: dict) -> None:
    """In each epoch of each attempt, the workers trained on disjoint samples, all of them together.

    The k-th epoch of an attempt is compared across the workers that drew the same sampler epoch
    there: workers at different epochs (one resumed from the snapshot, another started over) are
    not a sampler's mistake, and resumes-from-snapshot says what happened.
    """
    world, per_epoch = job["world"], _steps_per_epoch(job)
    for attempt, workers in sorted(_attempts(job).items()):
        for k in range(max((len(w["epochs"]) for w in workers), default=0)):
            at_k = [w for w in _by_rank(workers) if k < len(w["epochs"])]
            by_epoch: dict = {}
            for w in at_k:
                by_epoch.setdefault(w["epochs"][k]["epoch"], []).append(w)
            owner: dict[int, dict] = {}
            for same_epoch in by_epoch.values():
                owner = {}
                for w in same_epoch:
                    for i in w["epochs"][k]["indices"]:
                        other = owner.get(i)
                        if other is not None and other is not w:
                            _record(g, "sampler-global-rank", False, name, _shared_shard(attempt, k, other, w),
                                    rank=w["rank"], world=world)
                            return
                        owner[i] = w
            complete = len(workers) == world and len(at_k) == world and len(by_epoch) == 1 and \
                all(w["epochs"][k]["steps"] == per_epoch for w in at_k)
            if complete and len(owner) < NUM_SAMPLES:
                missing = sorted(set(range(NUM_SAMPLES)) - set(owner))
                _record(g, "sampler-global-rank", False, name, f"attempt {attempt}, epoch {k + 1} of the attempt: "
                        f"{len(missing)} of {NUM_SAMPLES} samples were never trained on (e.g. {missing[:5]}): the "
                        f"sampler needs num_replicas=WORLD_SIZE ({world}) and rank=RANK", world=world)
                return
    g.record("sampler-global-rank", True)


def _shared_shard(attempt: int, k: int, a: dict, b: dict) -> str:
    """Two workers that drew the same sampler epoch trained on some of the same samples: why, as far as seen."""
    ea, eb = a["epochs"][k], b["epochs"][k]
    same = sorted(set(ea["indices"]) & set(eb["indices"]))
    where = "two nodes got the same shard" if a["node"] != b["node"] else "two workers of one node got the same shard"
    told = ""
    if eb.get("rank") is not None:
        told = (f"; their DistributedSamplers had rank={ea.get('rank')} and rank={eb.get('rank')}, "
                f"num_replicas={ea.get('num_replicas')} and {eb.get('num_replicas')}")
        if eb.get("rank") == b["local_rank"] and b["local_rank"] != b["rank"]:
            told += f": {_who(b)} gave its LOCAL_RANK where its RANK belongs (the rank among all nodes' workers)"
        elif ea.get("rank") != eb.get("rank") and ea.get("num_replicas") == eb.get("num_replicas"):
            if ea.get("seed") != eb.get("seed"):
                told += (f", but seed={ea.get('seed')} and seed={eb.get('seed')}: each draws its shard from a "
                         "different permutation; every worker needs the same seed (seed=SEED)")
            elif ea.get("shuffle") != eb.get("shuffle"):
                told += (f", but shuffle={ea.get('shuffle')} and shuffle={eb.get('shuffle')}: each draws its shard "
                         "from a different order")
    return (f"attempt {attempt}, sampler epoch {ea.get('epoch')} (epoch {k + 1} of the attempt): {_who(a)} and "
            f"{_who(b)} both trained on samples {same[:6]}{'...' if len(same) > 6 else ''} ({len(same)} in common): "
            f"{where}{told}")


def check_set_epoch(g, name: str, job: dict) -> None:
    for w in sorted(job["workers"], key=lambda w: (w["attempt"], w["rank"] is None, w["rank"] or 0)):
        epochs = [e["epoch"] for e in w["epochs"]]
        if len(set(epochs)) != len(epochs):
            _record(g, "set-epoch", False, name, f"attempt {w['attempt']}: {_who(w)} trained {len(epochs)} epochs "
                    f"with the sampler at epoch {epochs}, so they repeat one order: call sampler.set_epoch(epoch) "
                    "before each epoch" + ("" if w["set_epoch"] else " (set_epoch was never called)"),
                    rank=w["rank"], world=job["world"])
            return
    g.record("set-epoch", True)


def check_final(g, name: str, job: dict, reference: dict) -> None:
    from grader.compare import largest_difference

    world = job["world"]
    last = max(_attempts(job).items(), default=(0, []))[1]
    if len(last) != world:
        _record(g, "matches-uninterrupted", False, name, f"the last attempt had {len(last)} worker(s), expected "
                f"{world}", world=world)
        return
    for w in _by_rank(last):
        if not w["finished"]:
            why = w["error"] or "no end was recorded"
            _record(g, "matches-uninterrupted", False, name, f"{_who(w)} of attempt {w['attempt']} did not finish "
                    f"main(): {_short_error(why)}", rank=w["rank"], world=world)
            return
        final = _read_final(w["final"])
        if final is None:
            _record(g, "matches-uninterrupted", False, name, f"{_who(w)}: the model built by build_model() could "
                    "not be read after main() returned", rank=w["rank"], world=world)
            return
        found = largest_difference(final, reference)
        if found is not None and (found.reason != "values" or found.max_abs > TOLERANCE):
            _record(g, "matches-uninterrupted", False, name, f"after the job, {_who(w)}'s parameters differ from "
                    f"{EPOCHS} epochs of training without a failure: {found}", rank=w["rank"], world=world)
            return
    g.record("matches-uninterrupted", True)


def check_snapshot(g, name: str, job: dict) -> None:
    """The snapshot left at the end: what the next restart would resume from."""
    world = job["world"]
    try:
        with open(_snapshot_path(job), "rb") as f:
            snapshot = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        _record(g, "snapshot-complete", False, name, f"there is no snapshot at --snapshot {SNAPSHOT} after the job",
                world=world)
        return
    except Exception as exc:
        _record(g, "snapshot-complete", False, name, f"the snapshot left after the job does not load with "
                f"weights_only=True: {_first_sentence(_error_text(exc))}", world=world)
        return
    keys = sorted(map(str, snapshot)) if isinstance(snapshot, dict) else None
    missing = [k for k in ("model", "optimizer", "epoch") if keys is None or k not in snapshot]
    if missing:
        held = keys if keys is not None else type(snapshot).__name__
        _record(g, "snapshot-complete", False, name, f"the snapshot holds {held}; missing {missing}"
                + (": without the optimizer's state, SGD's momentum starts again from zero after a restart"
                   if "optimizer" in missing else ""), world=world)
        return
    model, optimizer, epoch = snapshot["model"], snapshot["optimizer"], snapshot["epoch"]
    if epoch != EPOCHS - 1:
        _record(g, "snapshot-complete", False, name, f"the last snapshot says epoch {epoch!r}; the last epoch "
                f"finished is {EPOCHS - 1} (0-based)", world=world)
        return
    if not isinstance(model, dict) or any(str(k).startswith("module.") for k in model):
        _record(g, "snapshot-complete", False, name, "snapshot['model'] is not the unwrapped model's state_dict "
                "(its keys start with 'module.': save model.module.state_dict(), or the model before wrapping)",
                world=world)
        return
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    if not isinstance(state, dict) or len(state) != len(model) or \
            not all(isinstance(v, dict) and "momentum_buffer" in v for v in state.values()):
        held = len(state) if isinstance(state, dict) else 0
        _record(g, "snapshot-complete", False, name, f"snapshot['optimizer'] holds state for {held} of "
                f"{len(model)} parameters: save optimizer.state_dict() (SGD's momentum buffers)", world=world)
        return
    rank0 = next((w for w in max(_attempts(job).items(), default=(0, []))[1] if w["rank"] == 0), None)
    final = _read_final(rank0["final"]) if rank0 else None
    if final is not None:
        from grader.compare import first_difference

        found = first_difference(model, final)
        if found is not None:
            _record(g, "snapshot-complete", False, name, f"the last snapshot's model is not the trained model of "
                    f"RANK 0: {found}", world=world)
            return
    g.record("snapshot-complete", True)


def check_devices(g, name: str, job: dict) -> None:
    if g.backend != "nccl":
        g.skip("device-local-rank", "runs with NCCL only, on a machine with 4 GPUs (one per local rank)")
        return
    for w in job["workers"]:
        wanted = f"cuda:{w['local_rank']}"
        wrong = [d for d, _ in w["devices"] if d != wanted]
        if wrong:
            _record(g, "device-local-rank", False, name, f"{_who(w)} ran its model on {wrong[0]}; expected "
                    f"{wanted}, the GPU of its LOCAL_RANK", rank=w["rank"])
            return
    g.record("device-local-rank", True)


def _first_sentence(text: str, limit: int = 160) -> str:
    return re.split(r"(?<=[.!?]) ", str(text), maxsplit=1)[0][:limit]


def _short_error(text: str) -> str:
    """An error in a few words: gloo's long messages about a peer that died become one phrase."""
    for phrase in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"):
        if phrase in text:
            return f"lost a peer that died ({phrase})"
    if "connectFullMesh failed" in text:
        return "could not connect to its peers (gloo connectFullMesh failed)"
    return _first_sentence(re.sub(r"\[/[^\]]*\] ?", "", text))


# --- in the grader: the timeline ----------------------------------------------------------------


def timeline(jobs: dict) -> list[dict]:
    """Per job, per node and rank, in order: start, snapshot found, epochs, the kill, the restart, the end."""
    out = []
    for name, job in jobs.items():
        workers = job["workers"]
        t0 = min((w["start"] for w in workers), default=0.0)
        if job["agents"]:
            command = next(iter(job["agents"].values()))["command"]
        else:
            command = (f"main() with RANK=0 WORLD_SIZE=1, killed as its snapshot of epoch {KILL_EPOCH} reaches the "
                       "path, then the job launched again from scratch on the same --snapshot "
                       "(TORCHELASTIC_RESTART_COUNT=0)")
        out.append({"job": name, "event": "command", "text": f"{name}: {command}"})
        for w in sorted(workers, key=lambda w: (w["attempt"], w["node"], w["rank"] is None, w["rank"] or 0)):
            out.append(_worker_entry(name, w, t0, os.path.abspath(_snapshot_path(job))))
        if job["agents"]:
            codes = {node: a["returncode"] for node, a in sorted(job["agents"].items())}
            out.append({"job": name, "event": "exit", "codes": codes,
                        "text": f"{name}: torchrun exited with " + ", ".join(
                            f"node {n}: {_exit_text(job['agents'][n])}" for n in codes)})
    return out


def _worker_entry(name: str, w: dict, t0: float, path: str | None = None) -> dict:
    found = w["found"]
    if not found.get("exists"):
        snapshot = None
    elif found.get("error"):
        snapshot = "unreadable"
    elif found.get("epoch") is None:
        snapshot = "no epoch"  # a snapshot that holds no integer "epoch" (the tutorial's EPOCHS_RUN, say)
    else:
        snapshot = found["epoch"]
    loads = [ld for ld in w["loads"] if not ld.get("error") and (path is None or ld.get("path") in (path, None))]
    loaded = loads[0].get("epoch") if loads else None
    epochs = [e["epoch"] for e in w["epochs"]]
    if w["killed"]:
        k = w["killed"]
        ended = f"killed by the grader {k.get('why')} (sampler epoch {k.get('epoch')}, after step {k.get('steps')})"
    elif w["finished"]:
        ended = "finished"
    elif w["error"]:
        ended = f"stopped: {_short_error(w['error'])}"
    else:
        ended = "stopped by torchrun"
    entry = {
        "job": name, "event": "worker", "node": w["node"], "attempt": w["attempt"], "rank": w["rank"],
        "local_rank": w["local_rank"], "pid": w["pid"], "start_s": round(w["start"] - t0, 2),
        "end_s": round(w["end"] - t0, 2), "restart_count": w.get("restart_count"),
        "torchrun_restart_count": w.get("torchrun_restart_count"), "snapshot_found": snapshot,
        "loaded": bool(loads), "loaded_epoch": loaded, "epochs": epochs,
        "resumed_at": epochs[0] if w["attempt"] > 0 and epochs else None, "ended": ended,
    }
    if snapshot is None:
        found_text = "no snapshot"
    elif snapshot == "unreadable":
        found_text = "snapshot unreadable"
    elif snapshot == "no epoch":
        found_text = _snapshot_words(found)[len("the "):]
    else:
        found_text = f"snapshot of epoch {snapshot}"
    loaded_text = "" if not loads else f", loaded epoch {loaded}" if loaded is not None else ", loaded it"
    if w["node"] == "alone":
        where, again = "", f"relaunched (TORCHELASTIC_RESTART_COUNT {w.get('restart_count')}), " if w["attempt"] else ""
    else:
        where, again = f"node {w['node']}, ", "restarted, " if w["attempt"] else ""
        if w.get("torchrun_restart_count") not in (None, w.get("restart_count")):
            again += (f"TORCHELASTIC_RESTART_COUNT set to {w.get('restart_count')} (this node's agent said "
                      f"{w.get('torchrun_restart_count')}), ")
    entry["text"] = (f"{name}, {where}attempt {w['attempt']}: RANK {w['rank']} (LOCAL_RANK {w['local_rank']}) "
                     f"{entry['start_s']:.1f}-{entry['end_s']:.1f} s: {again}{found_text}{loaded_text}; trained "
                     f"epochs {epochs or 'none'}; {ended}")
    return entry


if __name__ == "__main__":
    worker_entry()
