"""Exercise 15, worker side: the exercise's constants, model and data, and everything that runs inside a
worker torchrun starts (see :mod:`grader.checks.ex15_elastic` for the whole exercise and the verdicts).

torchrun starts this very file in each worker (``python ex15_worker.py LEARNER_FILE --snapshot PATH``,
:func:`worker_entry`): it installs the probes, imports the learner's file and calls its ``main()``. The
probes write what they see to files at once, one JSON line per event, so that a worker killed without
warning leaves its record. The grader's single-worker run (``alone_main`` in
:mod:`grader.checks.ex15_jobs`) calls :func:`_run_main` in the warm pool instead.
"""

from __future__ import annotations

import io
import json
import linecache
import os
import signal
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
    """``python ex15_worker.py LEARNER_FILE [the script's own arguments]``, started by torchrun."""
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



if __name__ == "__main__":
    worker_entry()
