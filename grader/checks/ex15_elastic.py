"""Exercise 15: main() of a fault-tolerant training script, under a real torchrun.

The grader runs the learner's script as a user would, under ``python -m torch.distributed.run``,
twice at once, in one rank of its own (so its deadline and its killing of whole process groups
cover every agent and worker):

* "2 nodes x 2": two torchrun agents on this machine stand in for two nodes (``--nnodes 2
  --nproc-per-node 2 --rdzv-backend c10d --max-restarts 1``), joined at the rendezvous store the
  grader holds for the run (its port is never given up, so nothing else can take it). In the
  first attempt the worker with RANK 3 is killed (SIGKILL) in the middle of an epoch.
* "1 node x 4": one agent, ``--nnodes 1 --nproc-per-node 4``, the same script unchanged. In the
  first attempt global rank 0 is killed while it writes the snapshot, half-way through the bytes.

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
# Before them, main() as a single worker in the warm pool, twice: killed half-way through writing
# the snapshot of epoch KILL_EPOCH, then started again (a restart, without torchrun's cost).
ALONE = "1 worker, restarted"
ALONE_STEPS_PER_EPOCH = NUM_SAMPLES // BATCH_SIZE
ALONE_KILL = {"rank": 0, "write_after_step": (KILL_EPOCH + 1) * ALONE_STEPS_PER_EPOCH}

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
        _run_main(learner_path, script_args, folder, node, attempt, plan)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)  # the record is complete: skip seconds of interpreter teardown


def _run_main(learner_path: str, script_args: list[str], folder: str, node: str, attempt: int, plan: dict,
              import_learner=None) -> None:
    """The learner's main() with the probes installed; its model's parameters saved when it returns."""
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                          "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")}
    name = f"{node}-{attempt}-{env['LOCAL_RANK']}"
    rec = _Recorder(folder, f"events-{name}.jsonl")
    rec.event("start", pid=os.getpid(), node=node, attempt=attempt, env=env)
    snapshot_path = _snapshot_argument(script_args)
    rec.event("snapshot-found", **_peek(snapshot_path))
    armed = attempt == 0 and plan.get("rank") is not None and str(plan["rank"]) == env["RANK"]
    models: list = []
    _install_probes(rec, plan if armed else {}, os.path.dirname(snapshot_path) if snapshot_path else None, models)
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
        rec.event("error", error=f"{type(exc).__name__}: {exc}"[:600])
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
        return {"exists": True, "size": os.path.getsize(path), "error": f"{type(exc).__name__}: {exc}"[:300]}
    epoch = obj.get("epoch") if isinstance(obj, dict) else None
    return {"exists": True, "size": len(data), "epoch": epoch if isinstance(epoch, int) else None}


def _kill_self(rec: _Recorder, why: str) -> None:
    rec.event("killed", why=why, steps=rec.steps, epoch=rec.epoch)
    os.kill(os.getpid(), signal.SIGKILL)


def _install_probes(rec: _Recorder, plan: dict, snapshot_folder: str | None, models: list) -> None:
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
            _kill_self(rec, "mid-epoch")

    register_optimizer_step_post_hook(after_step)

    def load(f, *args, **kwargs):
        where = os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None
        try:
            result = _real_load(f, *args, **kwargs)
        except Exception as exc:
            rec.event("load", path=where, error=f"{type(exc).__name__}: {exc}"[:300])
            raise
        epoch = result.get("epoch") if isinstance(result, dict) else None
        rec.event("load", path=where, epoch=epoch if isinstance(epoch, int) else None)
        return result

    torch.load = torch.serialization.load = load
    if snapshot_folder is None:
        return
    inside = os.path.join(snapshot_folder, "")
    writing_kill = plan.get("write_after_step")

    busy = []  # set while the probes themselves open files

    def armed() -> bool:
        return writing_kill is not None and rec.steps >= writing_kill

    def save(obj, f, *args, **kwargs):
        path = os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        if isinstance(path, str) and os.path.abspath(path).startswith(inside):
            rec.event("write", op="torch.save", path=os.path.abspath(path))
            if armed():
                # Half of the bytes reach the file, then the worker dies: a torn write.
                buffer = io.BytesIO()
                _real_save(obj, buffer, *args, **kwargs)
                data = buffer.getvalue()
                busy.append(1)
                target = open(path, "wb") if isinstance(f, (str, os.PathLike)) else f
                target.write(data[:len(data) // 2])
                target.flush()
                _kill_self(rec, "while writing the snapshot")
        return _real_save(obj, f, *args, **kwargs)

    torch.save = torch.serialization.save = save

    def audit(event: str, args: tuple) -> None:
        if busy or event not in ("open", "os.rename", "os.remove"):
            return
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
                busy.append(1)
                rec.event("write", op="open", path=path)
                if armed():
                    truncating = (isinstance(mode, str) and "w" in mode) or \
                        bool(isinstance(flags, int) and flags & os.O_TRUNC)
                    if truncating:  # what this open was about to do, then the worker dies before writing
                        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
                    _kill_self(rec, "while writing the snapshot")
                busy.pop()
            elif event == "os.rename":
                src, dst = (os.path.abspath(os.fsdecode(a)) for a in args[:2])
                if dst.startswith(inside) or src.startswith(inside):
                    busy.append(1)
                    rec.event("write", op="rename", src=src, path=dst)
                    busy.pop()
        except Exception:  # never fail the learner's own call
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

    The process group meets at the store the grader holds for this run. ``attempt`` 0 is killed
    half-way through writing the snapshot of epoch KILL_EPOCH; attempt 1 starts again on the same
    folder, as torchrun would after that kill.
    """
    attempt = ctx.kwargs["attempt"]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                       "TORCHELASTIC_RESTART_COUNT": str(attempt)})
    folder = ctx.kwargs.get("folder") or os.path.join(ctx.run_dir, "alone")
    for sub in ("events", "snapshot"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    snapshot = os.path.join(folder, "snapshot", SNAPSHOT)

    def import_learner(path):
        return ctx.learner()  # the harness's import: an import error is reported as one

    _run_main(ctx.learner_path, ["--snapshot", snapshot], os.path.join(folder, "events"), "alone", attempt,
              ALONE_KILL, import_learner)
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
    needle = f"{ENV_TAG}={tag}".encode()
    killed = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X"):
                    continue
            os.kill(int(entry), signal.SIGKILL)
            killed += 1
        except (OSError, IndexError):
            continue
    return killed


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
            "restart_count": _int(env.get("TORCHELASTIC_RESTART_COUNT")),
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
                               "num_replicas": source.get("num_replicas"), "indices": [], "steps": 0})
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
        if job["plan"]:
            check_resume(g, name, job)
        check_writers(g, name, job)
        check_shards(g, name, job)
        check_set_epoch(g, name, job)
        check_final(g, name, job, reference)
        check_snapshot(g, name, job)
    check_atomic(g, ALONE, alone)


def run_alone(g) -> dict:
    """main() as one worker, killed half-way through writing a snapshot, then started again."""
    first = g.run("alone_main", 1, kwargs={"attempt": 0}, expect_ok=False, graded_size=1,
                  label="main() as one worker, killed while it writes the snapshot of epoch 2")
    folder = os.path.join(first.run_dir, "alone")
    workers = read_workers(folder)
    if not any(w["killed"] for w in workers):
        g.stop_on_failures(first)  # the learner's own error (not implemented, an exception), with its line
    g.run("alone_main", 1, kwargs={"attempt": 1, "folder": folder}, expect_ok=False, graded_size=1,
          label="main() as one worker again, as after a restart")
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
    return (f"{_who(target)} took {target['steps']} optimizer step(s) and never wrote a file next to the snapshot "
            f"after step {plan['write_after_step']} (the end of epoch {KILL_EPOCH}), where the grader kills it")


def _by_rank(workers: list[dict]) -> list[dict]:
    return sorted(workers, key=lambda w: (w["rank"] is None, w["rank"] if w["rank"] is not None else 0))


def check_resume(g, name: str, job: dict) -> None:
    """After the kill and the restart, every worker continues from the last complete snapshot."""
    world = job["world"]
    if _kill(job) is None:
        _record(g, "resumes-from-snapshot", False, name, f"the grader's kill never happened: {_why_no_kill(job)}",
                world=world)
        return
    restarted = _attempts(job).get(1, [])
    if not restarted:
        _record(g, "resumes-from-snapshot", False, name, "after the kill, the workers were never started again",
                world=world)
        return
    found = restarted[0]["found"]
    if not found.get("exists"):
        _record(g, "resumes-from-snapshot", False, name, f"when the workers started again there was no snapshot at "
                f"--snapshot {SNAPSHOT}: nothing to resume from", world=world)
        return
    if found.get("error"):
        _record(g, "resumes-from-snapshot", False, name, f"when the workers started again, the snapshot "
                f"({found.get('size')} bytes) could not be read: {_first_sentence(found['error'])}", world=world)
        return
    saved = found.get("epoch")
    resume_at = saved + 1 if isinstance(saved, int) else None
    path = os.path.abspath(_snapshot_path(job))
    for w in _by_rank(restarted):
        loads = [ld for ld in w["loads"] if ld.get("path") == path]
        trained = [e["epoch"] for e in w["epochs"]]
        if not loads:
            _record(g, "resumes-from-snapshot", False, name,
                    f"after the restart {_who(w)} never loaded the snapshot (of epoch {saved}) and trained "
                    f"{len(trained)} epoch(s), from the start: load it when it exists and continue at epoch "
                    f"{resume_at}", rank=w["rank"], world=world)
            return
        failed = next((ld for ld in loads if ld.get("error")), None)
        if failed:
            _record(g, "resumes-from-snapshot", False, name, f"after the restart {_who(w)}'s torch.load of the "
                    f"snapshot raised {_first_sentence(failed['error'], 200)}", rank=w["rank"], world=world)
            return
        if resume_at is not None and len(trained) != EPOCHS - resume_at:
            _record(g, "resumes-from-snapshot", False, name,
                    f"after the restart {_who(w)} loaded the snapshot of epoch {saved} but then trained "
                    f"{len(trained)} epoch(s) (sampler epochs {trained}); continuing at epoch {resume_at} leaves "
                    f"{EPOCHS - resume_at} of the {EPOCHS}", rank=w["rank"], world=world)
            return
        if trained and len(set(trained)) == len(trained) and trained[0] != resume_at:
            _record(g, "resumes-from-snapshot", False, name,
                    f"after the restart {_who(w)} loaded the snapshot of epoch {saved} and began with epoch "
                    f"{trained[0]}, expected {resume_at} (the saved epoch + 1)", rank=w["rank"], world=world)
            return
    g.record("resumes-from-snapshot", True)


def check_atomic(g, name: str, job: dict) -> None:
    """Killed half-way through writing: the path still holds the previous, complete snapshot."""
    killed = _kill(job)
    if killed is None or killed["killed"].get("why") != "while writing the snapshot":
        _record(g, "snapshot-atomic", False, name, f"the grader's kill never happened: {_why_no_kill(job)}",
                world=job["world"])
        return
    restarted = _attempts(job).get(1, [])
    found = restarted[0]["found"] if restarted else {}
    if not restarted:
        message = "the worker was not started again after the kill"
    elif not found.get("exists"):
        message = (f"the worker was killed half-way through writing the snapshot of epoch {KILL_EPOCH}, and then "
                   f"there was no snapshot at all: the one of epoch {KILL_EPOCH - 1} was gone before the new one "
                   "was complete")
    elif found.get("error"):
        message = (f"the worker was killed half-way through writing the snapshot of epoch {KILL_EPOCH}, and the "
                   f"restarted worker found a torn file at the path ({found.get('size')} bytes that do not load: "
                   f"{_first_sentence(found['error'])}): the snapshot of epoch {KILL_EPOCH - 1} had been overwritten in "
                   "place. Save to a temporary file, then os.replace it onto the path")
    else:
        g.record("snapshot-atomic", True)
        return
    _record(g, "snapshot-atomic", False, name, message, world=job["world"])


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
    """In each epoch of each attempt, the workers trained on disjoint samples, all of them together."""
    world, per_epoch = job["world"], _steps_per_epoch(job)
    for attempt, workers in sorted(_attempts(job).items()):
        for k in range(max((len(w["epochs"]) for w in workers), default=0)):
            owner: dict[int, dict] = {}
            complete = len(workers) == world
            for w in _by_rank(workers):
                if k >= len(w["epochs"]):
                    complete = False
                    continue
                epoch = w["epochs"][k]
                complete = complete and epoch["steps"] == per_epoch
                for i in epoch["indices"]:
                    other = owner.get(i)
                    if other is not None and other is not w:
                        _record(g, "sampler-global-rank", False, name, _shared_shard(attempt, k, other, w),
                                rank=w["rank"], world=world)
                        return
                    owner[i] = w
            if complete and len(owner) < NUM_SAMPLES:
                missing = sorted(set(range(NUM_SAMPLES)) - set(owner))
                _record(g, "sampler-global-rank", False, name, f"attempt {attempt}, epoch {k + 1} of the attempt: "
                        f"{len(missing)} of {NUM_SAMPLES} samples were never trained on (e.g. {missing[:5]}): the "
                        f"sampler needs num_replicas=WORLD_SIZE ({world}) and rank=RANK", world=world)
                return
    g.record("sampler-global-rank", True)


def _shared_shard(attempt: int, k: int, a: dict, b: dict) -> str:
    ea, eb = a["epochs"][k], b["epochs"][k]
    same = sorted(set(ea["indices"]) & set(eb["indices"]))
    where = "two nodes got the same shard" if a["node"] != b["node"] else "two workers of one node got the same shard"
    told = ""
    if eb.get("rank") is not None:
        told = (f"; their DistributedSamplers had rank={ea.get('rank')} and rank={eb.get('rank')}, "
                f"num_replicas={ea.get('num_replicas')} and {eb.get('num_replicas')}")
        if eb.get("rank") == b["local_rank"] and b["local_rank"] != b["rank"]:
            told += f": {_who(b)} gave its LOCAL_RANK where its RANK belongs (the rank among all nodes' workers)"
    return (f"attempt {attempt}, epoch {k + 1} of the attempt: {_who(a)} and {_who(b)} both trained on samples "
            f"{same[:6]}{'...' if len(same) > 6 else ''} ({len(same)} in common): {where}{told}")


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
                f"weights_only=True: {type(exc).__name__}: {_first_sentence(exc)}", world=world)
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
            command = (f"main() with RANK=0 WORLD_SIZE=1, killed while writing the snapshot of epoch {KILL_EPOCH}, "
                       "then main() again on the same --snapshot")
        out.append({"job": name, "event": "command", "text": f"{name}: {command}"})
        for w in sorted(workers, key=lambda w: (w["attempt"], w["node"], w["rank"] is None, w["rank"] or 0)):
            out.append(_worker_entry(name, w, t0))
        if job["agents"]:
            codes = {node: a["returncode"] for node, a in sorted(job["agents"].items())}
            out.append({"job": name, "event": "exit", "codes": codes,
                        "text": f"{name}: torchrun exited with " + ", ".join(
                            f"node {n}: {_exit_text(job['agents'][n])}" for n in codes)})
    return out


def _worker_entry(name: str, w: dict, t0: float) -> dict:
    found = w["found"]
    if not found.get("exists"):
        snapshot = None
    elif found.get("error"):
        snapshot = "unreadable"
    else:
        snapshot = found.get("epoch")
    loaded = next((ld.get("epoch") for ld in w["loads"] if not ld.get("error")), None)
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
        "end_s": round(w["end"] - t0, 2), "snapshot_found": snapshot, "loaded_epoch": loaded,
        "epochs": epochs, "resumed_at": epochs[0] if w["attempt"] > 0 and epochs else None, "ended": ended,
    }
    found_text = {None: "no snapshot", "unreadable": "snapshot unreadable"}.get(snapshot, f"snapshot of epoch {snapshot}")
    where = f"node {w['node']}, " if w["node"] != "alone" else ""
    entry["text"] = (f"{name}, {where}attempt {w['attempt']}: RANK {w['rank']} (LOCAL_RANK {w['local_rank']}) "
                     f"{entry['start_s']:.1f}-{entry['end_s']:.1f} s: {'restarted, ' if w['attempt'] else ''}"
                     f"{found_text}{f', loaded epoch {loaded}' if loaded is not None else ''}; trained epochs "
                     f"{epochs or 'none'}; {ended}")
    return entry


if __name__ == "__main__":
    worker_entry()
