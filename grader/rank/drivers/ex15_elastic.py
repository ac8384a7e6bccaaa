"""Exercise 15, rank side: the exercise's constants, model and data; the grader's rank drivers (``alone_main``,
``jobs_main``: the torchrun agents started, supervised and stopped); and what runs in each worker torchrun
starts: this very file (``python rank.py LEARNER_FILE --snapshot PATH``, :func:`torchrun_entry`) installs the
probes, imports the learner's file and calls its ``main()``. The probes write what they see to files at once,
one JSON line per event, so that a worker killed without warning leaves its record. Only the standard
library and torch are imported here: torchrun runs the file as a script."""

from __future__ import annotations

import glob
import io
import json
import linecache
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


def build_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def build_dataset():
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = torch.randint(0, 4, (NUM_SAMPLES,), generator=g)
    return TensorDataset(x, y)


# --- in every worker torchrun starts: this file, run as a script ------------------------------


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


def torchrun_entry() -> None:
    """``python rank.py LEARNER_FILE [the script's own arguments]``, started by torchrun."""
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
            from grader.rank.child import import_learner
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
                    rec.event("write", op="rename", src=src, path=dst, **(where() if dst == snapshot_path else {}))
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


# --- the grader's rank drivers: the agents started, waited for, stopped --------------------------

STOP_GRACE_S = 3.0  # an agent asked to stop (SIGTERM) gets this long to stop its workers
LINGER_S = 20.0  # an agent still running this long after its job's last worker ended is stopped
ENTRY_SCRIPT = os.path.abspath(__file__)  # what torchrun starts in each worker: this file


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
    import grader

    kit = os.path.dirname(os.path.dirname(os.path.abspath(grader.__file__)))  # the folder that holds the package
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
               ENTRY_SCRIPT, ctx.learner_path, "--snapshot", os.path.join(folder, "snapshot", SNAPSHOT)]
    log_path = os.path.join(folder, f"agent-{node}.log")
    log = open(log_path, "wb")
    # Its own process group, so that it can be stopped with everything it started but its workers
    # (torchrun puts each in a session of its own; _stop_tagged finds those).
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    shown = ["torchrun"] + command[3:command.index(ENTRY_SCRIPT)] + ["15_elastic.py", "--snapshot", SNAPSHOT]
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
    from grader.rank import harness

    return harness.reap_strays(tag, variable=ENV_TAG)


if __name__ == "__main__":
    torchrun_entry()
