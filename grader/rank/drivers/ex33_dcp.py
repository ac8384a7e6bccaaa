"""Exercise 33, rank side: the model and data every rank builds (the stub's, kept here so that the learner's
file cannot change them), what one rank holds, the watch on the background saves, and the save and load jobs."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from grader.rank import memory, probes, rank_timeline, wire
from grader.rank.child import RankContext
from grader.rank.drivers.shared.dtensors import local
from grader.rank.drivers.shared.learner_errors import ERROR_CHARS, learner_error, learner_frame
from grader.rank.drivers.shared.stub_models import MLP_IN, MLP_OUT, MLPModel

GLOBAL_BATCH = 12
LR, WEIGHT_DECAY = 1e-2, 0.01
SEED = 3300
FIRST_STEP = 8  # the save job's first step (as a job resumed once already: fewer steps to run)
RESUME_SAVES = (9, 10)  # into the resume folder; 9 then 10: folder names must sort as the steps do
LAST_STEP = 12  # the job that never stops
KILL_SAVES = (12, 13)  # into the kill folder: one save that completes, then one killed half-way
RECORDED = (9, 10, 11, 12)  # the parameters recorded after these steps
HOLD_S = 0.25  # the slow disk: a background thread's first write in the resume folder waits at least this long
HOLD_CAP_S = 5.0  # and at most this long, whatever the other saves do
WAIT_S = 15.0  # at most this long for the background saves to end
KILL_WAIT_S = 1.5  # a rank the killed save never makes write is killed after this
STALL_TIMEOUT_S = 20.0  # a collective left waiting by a rank that failed ends after this
FINGERPRINT_BYTES = 1024  # parameters smaller than this are not looked for in memory
RESUME, KILL = "resume", "kill"
OBSERVATIONS = "observations{rank}.bin"
KILLED = "killed{rank}.txt"
COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "barrier",
               "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "gather",
               "scatter", "reduce", "all_to_all_single", "send", "recv", "isend", "irecv")
REFUSED = ("ddp-grade refused torch.distributed.{op} from a background thread on the process group training "
           "uses: give the background save a group of its own, dist.new_group(backend='gloo')")


# --- the model and the data: the stub's, kept here so that the learner's file cannot change them ------------


def build_model() -> MLPModel:
    torch.manual_seed(SEED)
    return MLPModel()


def shard_model(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of step ``step``'s global batch (the same global batch at any world size)."""
    generator = torch.Generator().manual_seed(SEED + step)
    x = torch.randn(GLOBAL_BATCH, MLP_IN, generator=generator)
    y = torch.randn(GLOBAL_BATCH, MLP_OUT, generator=generator)
    return torch.tensor_split(x, world_size)[rank], torch.tensor_split(y, world_size)[rank]


def train_step(model: nn.Module, optimizer, step: int, ctx: RankContext) -> None:
    x, y = batch(step, ctx.rank, ctx.world_size)
    out = model(x.to(ctx.device))
    # The summed error scaled so that FSDP's average over the ranks is the global batch's mean, however
    # the rows are split: the same steps on 2, 3 or 4 ranks.
    loss = F.mse_loss(out, y.to(ctx.device), reduction="sum") * ctx.world_size / (GLOBAL_BATCH * MLP_OUT)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def new_job(ctx: RankContext, mesh):
    model = shard_model(build_model().to(ctx.device), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


# --- what one rank holds ---------------------------------------------------------------------------------




def params_of(model: nn.Module) -> dict:
    return {name: local(p) for name, p in model.named_parameters()}


def optimizer_of(model: nn.Module, optimizer) -> dict:
    """Each parameter's optimizer state, by the parameter's name: local shards, and the step as a float."""
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        out[name] = {key: (local(v) if v.dim() else float(v)) if isinstance(v, torch.Tensor) else v
                     for key, v in state.items() if isinstance(v, (torch.Tensor, int, float))}
    return out


def fingerprints(model: nn.Module, world_size: int, gather) -> dict[str, bytes]:
    """The bytes of each large parameter whole: every rank's dim-0 shard in rank order (no tensor is built)."""
    out = {}
    for name, p in model.named_parameters():
        if p.numel() * p.element_size() < FINGERPRINT_BYTES:
            continue
        parts: list = [None] * world_size
        gather(parts, memory.tensor_bytes(local(p)))
        out[name] = b"".join(parts)
    return out


# --- the watch ----------------------------------------------------------------------------------------


_GRADER = os.path.join(os.path.dirname(os.path.abspath(memory.__file__)), "")  # the grader package's files
_WATCHES: list = []
_AUDIT_ADDED = False
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _audit(event: str, args: tuple) -> None:
    if _WATCHES and event in ("open", "os.rename"):
        for watch in list(_WATCHES):
            watch.file_event(event, args)


def _path(value) -> str | None:
    if isinstance(value, (str, bytes, os.PathLike)):
        path = os.fspath(value)
        return os.path.abspath(path.decode(errors="replace") if isinstance(path, bytes) else path)
    return None


class Watch:
    """What one rank observes of the learner's calls (the module docstring says what and how)."""

    def __init__(self, ctx: RankContext, folders: dict[str, str], *, hold: str | None = None, refuse: bool = False):
        self.ctx = ctx
        self.main = threading.main_thread()
        self.folders = {name: os.path.join(os.path.abspath(path), "") for name, path in folders.items()}
        self.hold, self.refuse = hold, refuse
        self.threads: dict = {self.main: 0}
        self.held_threads: dict = {}  # thread -> the save call that started it (its number)
        self.started: dict[int, list] = {}  # save call number -> the threads it started
        self.calls = 0
        self.writes: list[dict] = []
        self.collectives: list[dict] = []
        self.memory: list[dict] = []
        self.scans = 0
        self.call: str | None = None  # the learner's call now running in the main thread
        self.roots: list = []
        self.prints: dict[str, bytes] = {}
        self.training: set = set()
        self.kill_note: str | None = None
        self.killing = self.scanning = False
        self.learner = None

    # files ------------------------------------------------------------------------------------------

    def thread_key(self) -> int:
        return self.threads.setdefault(threading.current_thread(), len(self.threads))

    def folder_of(self, path: str | None) -> str | None:
        return next((name for name, folder in self.folders.items() if path and path.startswith(folder)), None)

    def file_event(self, event: str, args: tuple) -> None:
        if self.killing:
            return
        try:
            main = threading.current_thread() is self.main
            if event == "open":
                path, mode, flags = args[0], args[1], args[2]
                target = _path(path)
                folder = self.folder_of(target)
                if folder is None:
                    return
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                    bool(isinstance(flags, int) and flags & _WRITE_FLAGS)
                if not writing:
                    return
                record = {"op": "open", "path": target}
            else:
                source, target = _path(args[0]), _path(args[1])
                folder = self.folder_of(target) or self.folder_of(source)
                if folder is None:
                    return
                record = {"op": "rename", "src": source, "path": target}
            record.update(folder=folder, t=time.monotonic(), thread=self.thread_key(), main=main)
            self.writes.append(record)
            if self.kill_note is not None and folder == KILL:
                self.kill(target, mode, flags) if record["op"] == "open" else self.kill(None, None, None)
            if main and self.call:
                self.scan(f"writing {os.path.basename(target)}")
            thread = threading.current_thread()
            if folder == self.hold and not main and record["op"] == "open" and thread not in self.held_threads:
                self.hold_write(thread)
                self.writes.append(dict(record, op="held", t=time.monotonic()))
        except Exception:  # an audit hook that raises would fail the learner's own call
            pass

    def hold_write(self, thread) -> None:
        """The slow disk: this thread's first write waits HOLD_S, and the saves' writes go in the order of
        the saves. A thread of a later save waits until the threads of earlier saves have ended; one of an
        earlier save waits until the threads of the saves called since (if they returned) are held here
        or ended. So two saves in flight at once always run in the same order on every rank: the first
        one's planning, the second one's planning, the first one's writes, the second one's."""
        call = next((n for n, threads in self.started.items() if thread in threads), self.calls)
        self.held_threads[thread] = call
        now = time.monotonic()
        until, cap = now + HOLD_S, now + HOLD_CAP_S
        while now < cap and (now < until or not self.may_write(thread, call)):
            time.sleep(0.005)
            now = time.monotonic()

    def may_write(self, thread, call: int) -> bool:
        for later, threads in list(self.started.items()):
            if later > call and any(t.is_alive() and t not in self.held_threads for t in threads):
                return False
        return not any(other is not thread and number < call and other.is_alive()
                       for other, number in list(self.held_threads.items()))

    def kill(self, target: str | None, mode, flags) -> None:
        """Die as a job killed right after opening ``target`` would: the file created or truncated, nothing
        in it (``target`` None: killed just before a rename)."""
        self.killing = True
        with contextlib.suppress(OSError), open(self.kill_note, "w") as note:
            note.write(target or "")
        if target is not None:
            truncate = (isinstance(mode, str) and "w" in mode) or bool(isinstance(flags, int) and flags & os.O_TRUNC)
            with contextlib.suppress(OSError):
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0), 0o644))
        os.kill(os.getpid(), signal.SIGKILL)

    # collectives -----------------------------------------------------------------------------------------

    def is_training(self, group) -> bool:
        return group is None or getattr(group, "group_name", None) in self.training

    def wrap(self, name: str, original, depth):
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None

        def observed(*args, **kwargs):
            main = threading.current_thread() is self.main
            if getattr(depth, "value", 0) or (main and self.call is None):  # nested, or the grader's training
                return original(*args, **kwargs)
            group = kwargs.get("group")
            if signature is not None:
                with contextlib.suppress(TypeError):
                    group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            record = {"op": name, "t": time.monotonic(), "t_end": None, "thread": self.thread_key(), "main": main,
                      "training_group": self.is_training(group), "refused": False}
            self.collectives.append(record)
            if self.refuse and not main and record["training_group"]:
                record["refused"] = True
                raise RuntimeError(REFUSED.format(op=name))
            depth.value = 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.value = 0
                record["t_end"] = time.monotonic()
                if main and self.call:
                    self.scan(f"after {name}")

        return observed

    # memory ----------------------------------------------------------------------------------------------

    def scan(self, where: str) -> None:
        """Search every tensor this rank can reach now for the bytes of a whole large parameter."""
        if self.scanning or not self.prints:
            return
        self.scanning = True
        try:
            roots = list(self.roots) + ([vars(self.learner)] if self.learner is not None else [])
            for frame in sys._current_frames().values():
                while frame is not None:
                    if not frame.f_code.co_filename.startswith(_GRADER):  # the grader's own frames hold nothing of it
                        roots.append(frame.f_locals)
                    frame = frame.f_back
            name = self.learner.__name__ if self.learner is not None else ""
            storages = memory.distinct_storages(memory.reachable_tensors(roots, name))
            held = memory.found_in([memory.storage_bytes(s) for s in storages.values()], self.prints)
            self.scans += 1
            if held:
                self.memory.append({"call": self.call, "where": where, "names": held})
        finally:
            self.scanning = False

    def attach(self, model: nn.Module, optimizer, prints: dict[str, bytes]) -> None:
        self.roots, self.prints = [model, optimizer], prints

    @contextlib.contextmanager
    def calling(self, label: str, started: list):
        """The learner's call ``label`` runs in the main thread: watched, and scanned as it returns;
        ``started`` gets the threads it started (still running when it returned)."""
        before = set(threading.enumerate())
        self.calls += 1
        self.call = label
        try:
            yield
        finally:
            self.scan("as it returned")
            self.call = None
            started.extend(t for t in threading.enumerate() if t not in before)
            self.started[self.calls] = list(started)

    @contextlib.contextmanager
    def installed(self):
        global _AUDIT_ADDED
        if not _AUDIT_ADDED:
            sys.addaudithook(_audit)  # for the rest of this process: audit hooks cannot be removed
            _AUDIT_ADDED = True
        depth = threading.local()
        real_save, real_load = torch.save, torch.load

        def save(obj, f, *args, **kwargs):
            target = _path(f)
            folder = self.folder_of(target)
            if folder and not self.killing:
                self.writes.append({"op": "torch.save", "path": target, "folder": folder, "t": time.monotonic(),
                                    "thread": self.thread_key(), "main": threading.current_thread() is self.main})
                if self.kill_note is not None and folder == KILL:
                    self.kill(target, "wb", 0)
            if self.call and self._from_learner():
                self.scan("in torch.save")
            return real_save(obj, f, *args, **kwargs)

        def load(*args, **kwargs):
            result = real_load(*args, **kwargs)
            if self.call and self._from_learner():
                self.scan("after torch.load")
            return result

        _WATCHES.append(self)
        try:
            with contextlib.ExitStack() as stack:
                for name in COLLECTIVES:
                    if hasattr(dist, name):
                        stack.enter_context(probes.patched(dist, name, self.wrap(name, getattr(dist, name), depth)))
                for owner in (torch, torch.serialization):
                    stack.enter_context(probes.patched(owner, "save", save))
                    stack.enter_context(probes.patched(owner, "load", load))
                yield self
        finally:
            _WATCHES.remove(self)

    def _from_learner(self) -> bool:
        """Whether the learner's own code called the function that called this (not torch's DCP)."""
        caller = sys._getframe(2)
        return self.learner is not None and os.path.abspath(caller.f_code.co_filename) == \
            os.path.abspath(getattr(self.learner, "__file__", "") or "")

    def record(self) -> dict:
        return {"writes": list(self.writes), "collectives": list(self.collectives), "memory": list(self.memory),
                "scans": self.scans}


def _checkpoint_error(exc: BaseException) -> str:
    """The exception with the learner's frame (file, line and its text)."""
    if isinstance(exc, CheckpointException) and exc.failures:  # its text holds every rank's traceback
        rank, (cause, _) = min(exc.failures.items(), key=lambda item: item[0])
        text = f"CheckpointException (ranks {sorted(exc.failures)}); rank {rank}'s: {type(cause).__name__}: {cause}"
        return text[:ERROR_CHARS] + learner_frame(exc)
    return learner_error(exc)


def _setup(ctx: RankContext, watch: Watch):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    watch.training = {getattr(g, "group_name", None) for g in (dist.group.WORLD, mesh.get_group())}
    watch.learner = ctx.learner()
    return mesh


# --- the save job ---------------------------------------------------------------------------------------


def save_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    torch.set_num_threads(1)
    ctx.init_group()
    folders = {RESUME: os.path.join(ctx.run_dir, RESUME), KILL: os.path.join(ctx.run_dir, KILL)}
    watch = Watch(ctx, folders, hold=RESUME, refuse=True)
    with watch.installed():
        save = ctx.function("save")
        ctx.function("load")  # a missing name is reported before anything runs
        mesh = _setup(ctx, watch)
        model, optimizer = new_job(ctx, mesh)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        obs = {"saves": [], "params": {}, "optimizer": None, "waited": [], "t0": time.monotonic()}
        job = _Job(ctx, watch, save, model, optimizer, obs)
        with rank_timeline.recording() as recorder:  # up to the killed save: the process ends in it
            finished = job.run()
        obs["timeline"] = recorder.snapshot()
        obs.update(watch.record())
        _write(ctx, obs)
        if finished:  # the last save, killed half-way: the process ends here
            watch.kill_note = os.path.join(ctx.run_dir, KILLED.format(rank=ctx.rank))
            job.killed_save()
    return {"observations": OBSERVATIONS.format(rank=ctx.rank)}


class _Job:
    """The save job's steps, one save call at a time (save_main says in which order)."""

    def __init__(self, ctx, watch, save, model, optimizer, obs):
        self.ctx, self.watch, self.save, self.model, self.optimizer, self.obs = ctx, watch, save, model, optimizer, obs
        self.step = FIRST_STEP - 1
        self.threads: list = []  # the threads the learner's saves started
        self.last: dict | None = None

    def train_to(self, last: int) -> None:
        while self.step < last:
            if self.last is not None and self.last.get("next_step_started") is None:
                self.last["next_step_started"] = time.monotonic()
            self.step += 1
            train_step(self.model, self.optimizer, self.step, self.ctx)
            if self.step in RECORDED:
                self.obs["params"][self.step] = params_of(self.model)
            if self.step == RESUME_SAVES[-1]:
                self.obs["optimizer"] = optimizer_of(self.model, self.optimizer)

    def call_save(self, folder: str) -> bool:
        """The learner's save after this step, into ``folder``; False when it raised."""
        self.watch.attach(self.model, self.optimizer,
                          fingerprints(self.model, self.ctx.world_size, dist.all_gather_object))
        entry = {"folder": folder, "step": self.step, "called": time.monotonic(), "returned": None, "error": None,
                 "next_step_started": None, "threads": []}
        self.obs["saves"].append(entry)
        new: list = []
        try:
            with self.watch.calling(f"save(path, model, optimizer, step={self.step})", new), \
                    rank_timeline.phase("save", f"save, step {self.step}"):
                self.save(self.watch.folders[folder].rstrip(os.sep), self.model, self.optimizer, self.step)
        except NotImplementedError:
            raise
        except (Exception, CheckpointException) as exc:  # e.g. a refused save's, raised by the next .result()
            entry["error"] = _checkpoint_error(exc)
        entry["returned"] = time.monotonic()
        entry["threads"] = [self.watch.threads.setdefault(t, len(self.watch.threads)) for t in new]
        self.threads.extend(new)
        self.last = entry
        return entry["error"] is None

    def wait(self) -> None:
        """Let the background saves end (as a job must before it leaves its group)."""
        until = time.monotonic() + WAIT_S
        for thread in self.threads:
            thread.join(max(0.0, until - time.monotonic()))
        self.obs["waited"].append({"after": self.step, "t": time.monotonic(),
                                   "running": [self.watch.threads.get(t) for t in self.threads if t.is_alive()]})

    def run(self) -> bool:
        """Everything but the killed save; False when a save raised (the job stops there)."""
        self.train_to(RESUME_SAVES[0])
        for step in RESUME_SAVES:
            self.train_to(step)
            if not self.call_save(RESUME):
                return False
        self.train_to(LAST_STEP)
        self.wait()
        self.train_to(KILL_SAVES[0])
        if not self.call_save(KILL):
            return False
        self.wait()
        return True

    def killed_save(self) -> None:
        self.train_to(KILL_SAVES[1])
        with contextlib.suppress(Exception, CheckpointException):
            self.save(self.watch.folders[KILL].rstrip(os.sep), self.model, self.optimizer, self.step)
        time.sleep(KILL_WAIT_S)  # a background write, if any, is killed meanwhile
        os.kill(os.getpid(), signal.SIGKILL)


def _write(ctx: RankContext, obs: dict) -> None:
    """The observations, in a file: the process is killed before it could return them."""
    path = os.path.join(ctx.run_dir, OBSERVATIONS.format(rank=ctx.rank))
    with open(path + ".tmp", "wb") as f:
        f.write(wire.dumps(obs))
    os.replace(path + ".tmp", path)


# --- the load job ---------------------------------------------------------------------------------------


@rank_timeline.traced
def load_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    torch.set_num_threads(1)
    with ctx.group():
        watch = Watch(ctx, ctx.kwargs["folders"])
        with watch.installed():
            load = ctx.function("load")
            mesh = _setup(ctx, watch)
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
            out = {}
            for folder in ctx.kwargs["load"]:
                model, optimizer = new_job(ctx, mesh)
                watch.attach(model, optimizer, ctx.kwargs["fingerprints"][folder])
                out[folder] = _load(ctx, watch, load, folder, model, optimizer)
                if folder == RESUME and out[folder]["error"] is None:
                    for step in range(RESUME_SAVES[-1] + 1, LAST_STEP + 1):  # the steps after the newest save
                        train_step(model, optimizer, step, ctx)
                    out[folder]["final"] = params_of(model)
        out.update(watch.record())
        return out


def _load(ctx: RankContext, watch: Watch, load, folder: str, model, optimizer) -> dict:
    entry = {"returned": None, "error": None}
    try:
        with watch.calling(f"load(path, model, optimizer) of the {folder} folder", []):
            returned = load(watch.folders[folder].rstrip(os.sep), model, optimizer)
        entry["returned"] = returned if isinstance(returned, (int, float, str, type(None))) else repr(returned)[:80]
    except NotImplementedError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's own is a BaseException
        entry["error"] = _checkpoint_error(exc)
        return entry
    entry["params"] = params_of(model)
    entry["optimizer"] = optimizer_of(model, optimizer)
    return entry
