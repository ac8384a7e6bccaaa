"""Exercise 29: a sharded checkpoint that resumes on 2 ranks and not on 3 (each rank torch.saves its own local
shards to rank{r}.pt and copies them back: the files are as many as the ranks that saved, and each holds that
sharding's pieces): the drivers, run in each rank (the checks that decide:
grader/checks/ex29_reshard_resume.py).

The track's job runner; a first job on 2 processes trains 1 epoch and saves a checkpoint into
--out/checkpoint, while the grader records every file each rank opens for writing there (an audit hook, and
torch.save, whose files are opened outside Python). At each such file it looks at what the rank holds: its
model's and momentum's own shards (their bytes), and any whole parameter among the tensors its running code
can reach; after the job each rank reads back the files it wrote. Then a job on 2 and a job on 3 processes
resume from that folder (--resume) and train epoch 1.
"""

from __future__ import annotations

import os
import sys

import torch

from grader.rank import memory, probes
from grader.rank.child import RankContext
from grader.rank.drivers.shared import debug_rank


FIRST_EPOCHS = 1  # the first job: epoch 0, and a checkpoint after it
EPOCHS = 2  # the resumed jobs go on to this many epochs in all
CHECKPOINT = "checkpoint"


def make_data() -> dict:
    return debug_rank.job_tokens(seed=29)
_WRITES: list | None = None  # while a job runs: the files this rank opens for writing
_AUDIT_ADDED = False


def _audit(event: str, args: tuple) -> None:
    if _WRITES is None or event != "open" or len(args) < 3:
        return
    path, mode, flags = args[0], args[1], args[2]
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    if writing and isinstance(path, (str, bytes, os.PathLike)):
        _WRITES.append(os.fsdecode(path))
        if _HELD is not None:
            _HELD.scan(os.fsdecode(path), [])


def first_main(ctx: RankContext) -> dict:
    """The first job, with the files each rank wrote under --out/checkpoint, what they hold, and what the rank
    held while it wrote them."""
    global _WRITES, _AUDIT_ADDED, _HELD
    if not _AUDIT_ADDED:
        sys.addaudithook(_audit)  # cannot be removed: it records only while _WRITES is a list
        _AUDIT_ADDED = True
    folder = os.path.join(os.path.realpath(ctx.run_dir), "out", CHECKPOINT) + os.sep
    _WRITES, _HELD = [], Held(os.path.abspath(ctx.learner_path), folder)
    original_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            _WRITES.append(os.fsdecode(f))
            _HELD.scan(os.fsdecode(f), [obj])
        return original_save(obj, f, *args, **kwargs)

    try:
        with probes.patched(torch, "save", save), probes.patched(torch.serialization, "save", save):
            record = debug_rank.run_job(ctx, ["--data", debug_rank.write_data(ctx, make_data())],
                                       epochs=FIRST_EPOCHS)
    finally:
        writes, _WRITES = _WRITES, None
        held, _HELD = _HELD, None
    record["written"] = sorted({os.path.relpath(os.path.realpath(p), folder) for p in writes
                                if os.path.realpath(p).startswith(folder)})
    record.update(held.record())
    record["files"] = read_own_files(folder, record["written"])
    return record


# What a rank holds as it writes the checkpoint: its own shards, found byte for byte in its files, and no whole
# parameter. Parameters of fewer bytes per shard than this are left out (a few numbers can match by chance).
FINGERPRINT_BYTES = 512
FILES_BYTES = 8 * 1024 * 1024  # of the files a rank wrote, at most this much is read back (the job's are ~100 kB)
_HELD = None  # while the first job runs: the Held of this rank


class Held:
    """At each file a rank writes into the checkpoint folder: its model's and momentum's own shards (their bytes,
    the last seen: the checkpoint's), and the whole parameters (or whole momentum buffers) it then holds, found
    among the tensors its running code can reach: a plain tensor of a sharded parameter's full shape that contains
    this rank's own shard of it."""

    def __init__(self, learner_file: str, folder: str):
        self.learner_file, self.folder = learner_file, folder
        self.prints: dict[str, bytes] = {}
        self.momentum: dict[str, bytes] = {}
        self.whole: list[dict] = []
        self.scans = 0
        self.busy = False

    def scan(self, path: str, extra: list) -> None:
        if self.busy or not os.path.realpath(path).startswith(self.folder):
            return
        self.busy = True
        try:
            self._scan(os.path.relpath(os.path.realpath(path), self.folder), extra)
        except Exception:  # never fail the learner's own write
            pass
        finally:
            self.busy = False

    def _scan(self, name: str, extra: list) -> None:
        from torch.distributed.tensor import DTensor

        roots, where = list(extra), ""
        for frame in sys._current_frames().values():
            while frame is not None:
                if os.path.abspath(frame.f_code.co_filename) == self.learner_file:
                    roots.append(frame.f_locals)
                    where = where or f"line {frame.f_lineno}, in {frame.f_code.co_name}"
                frame = frame.f_back
        model, optimizer = _model_and_optimizer(roots)
        if model is None:
            return
        self.scans += 1
        sharded = {}
        for pname, p in model.named_parameters():
            if not isinstance(p, DTensor) or tuple(p.to_local().shape) == tuple(p.shape):
                continue
            own = memory.tensor_bytes(p.to_local())
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            buffer = state.get("momentum_buffer")
            moment = memory.tensor_bytes(buffer.to_local()) if isinstance(buffer, DTensor) else None
            if len(own) >= FINGERPRINT_BYTES:
                self.prints[pname] = own
                if moment is not None:
                    self.momentum[pname] = moment
            sharded[pname] = (tuple(p.shape), own, moment)
        found = []
        for t in memory.reachable_tensors(roots, ""):
            if isinstance(t, DTensor) or t.dim() == 0:
                continue
            for pname, (shape, own, moment) in sharded.items():
                if tuple(t.shape) != shape or not _readable(t):
                    continue
                raw = memory.tensor_bytes(t)
                if own in raw:
                    found.append(pname)
                elif moment is not None and moment in raw:
                    found.append(f"{pname} (its momentum)")
        if found:
            self.whole.append({"file": name, "where": where, "names": sorted(set(found))})

    def record(self) -> dict:
        return {"prints": self.prints, "momentum_prints": self.momentum, "whole": self.whole[:8],
                "scans": self.scans}


def _readable(t: torch.Tensor) -> bool:
    """Whether a tensor's values can be read (an FSDP parameter's unsharded storage is freed, not its shape)."""
    try:
        return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _model_and_optimizer(roots: list):
    """The module with the most DTensor parameters reachable from ``roots`` through containers and attributes
    (a few levels: a script's locals, a state dict, an app-state object), and an optimizer stepping it."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    modules, optimizers, seen = [], [], set()
    level = list(roots)
    for _ in range(4):
        following = []
        for obj in level:
            if id(obj) in seen or isinstance(obj, (str, bytes, int, float, torch.Tensor)):
                continue
            seen.add(id(obj))
            if isinstance(obj, nn.Module):
                modules.append(obj)
                continue
            if isinstance(obj, torch.optim.Optimizer):
                optimizers.append(obj)
                continue
            if isinstance(obj, dict):
                following.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                following.extend(obj)
            elif hasattr(obj, "__dict__") and not isinstance(obj, type):
                following.extend(vars(obj).values())
        level = following
    sharded = [(sum(isinstance(p, DTensor) for p in m.parameters()), m) for m in modules]
    sharded = [(n, m) for n, m in sharded if n]
    if not sharded:
        return None, None
    model = max(sharded, key=lambda item: item[0])[1]
    ids = {id(p) for p in model.parameters()}
    optimizer = next((o for o in optimizers if any(id(p) in ids for group in o.param_groups for p in group["params"])),
                     None)
    return model, optimizer


def read_own_files(folder: str, written: list[str]) -> dict[str, bytes]:
    """The bytes of the files this rank wrote in the checkpoint folder (read here, in the rank)."""
    out, left = {}, FILES_BYTES
    for name in written:
        path = os.path.join(folder, name)
        try:
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                data = f.read(left)
        except OSError:
            continue
        out[name] = data
        left -= len(data)
        if left <= 0:
            break
    return out


def resume_main(ctx: RankContext) -> dict:
    return debug_rank.run_job(ctx, ["--data", debug_rank.write_data(ctx, make_data()), "--resume",
                                   ctx.kwargs["resume"]], epochs=EPOCHS)
