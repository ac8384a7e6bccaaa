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

# The two jobs: how torchrun is started, and what the grader does to the first attempt.
KILL_EPOCH = 2  # both kills happen in (or at the end of) this epoch; the snapshot of KILL_EPOCH - 1 is complete
JOBS = {
    "2 nodes x 2": {"nodes": ("a", "b"), "nproc": 2,
                    # RANK 3, after its second optimizer step of epoch KILL_EPOCH: mid-epoch
                    "kill": {"rank": 3, "after_step": KILL_EPOCH * STEPS_PER_EPOCH + 2}},
    "1 node x 4": {"nodes": ("a",), "nproc": 4,
                   # global rank 0, at its first write near the snapshot after epoch KILL_EPOCH's last step
                   "kill": {"rank": 0, "write_after_step": (KILL_EPOCH + 1) * STEPS_PER_EPOCH}},
}
RESUME_EPOCH = KILL_EPOCH  # the epoch after the last complete snapshot (KILL_EPOCH - 1)

# Handed from the grader's rank to the agents, and from them to every worker.
ENV_EVENTS = "DDP_GRADE_EX15_EVENTS"  # the folder of event files
ENV_JOB = "DDP_GRADE_EX15_JOB"  # the job's name
ENV_NODE = "DDP_GRADE_EX15_NODE"  # which agent ("a" or "b")
ENV_KILL = "DDP_GRADE_EX15_KILL"  # the kill plan, JSON
ENV_TAG = "DDP_GRADE_EX15_TAG"  # a value only this grading's processes carry
STOP_GRACE_S = 3.0  # an agent asked to stop (SIGTERM) gets this long to stop its workers


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


def _attempt(folder: str, job: str, node: str, local_rank: str) -> int:
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
    folder, job, node = os.environ[ENV_EVENTS], os.environ[ENV_JOB], os.environ[ENV_NODE]
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                          "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")}
    attempt = _attempt(folder, job, node, env["LOCAL_RANK"])
    rec = _Recorder(folder, f"events-{node}-{attempt}-{env['LOCAL_RANK']}.jsonl")
    rec.event("start", pid=os.getpid(), node=node, attempt=attempt, env=env)
    snapshot_path = _snapshot_argument(script_args)
    rec.event("snapshot-found", **_peek(snapshot_path))
    plan = json.loads(os.environ.get(ENV_KILL) or "{}")
    armed = attempt == 0 and plan.get("rank") == int(env["RANK"] or -1)
    models: list = []
    _install_probes(rec, plan if armed else {}, os.path.dirname(snapshot_path) if snapshot_path else None, models)

    sys.argv = [learner_path, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(learner_path)))
    try:
        from grader.child import import_learner

        module = import_learner(learner_path)
        _wrap_build_model(module, rec, models)
        module.main()
    except BaseException as exc:
        rec.event("error", error=f"{type(exc).__name__}: {exc}"[:600])
        raise
    rec.event("end", steps=rec.steps)
    if models:
        _real_save({k: v.detach().to("cpu", copy=True) for k, v in models[-1].state_dict().items()},
                   os.path.join(folder, f"final-{node}-{attempt}-{env['LOCAL_RANK']}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the record is complete: skip seconds of interpreter teardown


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
    for agent in agents:
        remaining = deadline - time.monotonic()
        try:
            agent["returncode"] = agent["process"].wait(timeout=max(0.1, remaining))
        except subprocess.TimeoutExpired:
            agent["returncode"] = None
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
                                        "log": log[-4000:]}
    return out


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


if __name__ == "__main__":
    worker_entry()
