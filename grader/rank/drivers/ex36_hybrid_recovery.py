"""Exercise 36, rank side: the model every rank builds (the stub's, which is 33's: checks/shared/stub_models.py),
the batches, the layout graded at each world size, and one job per world size: the learner's shard_hybrid, steps
of AdamW with every collective's group recorded, the same steps again without a failure (the replay), then a
replica wiped and the learner's recover_from_peer watched (every message below the Python API, files opened for
writing, whole tensors looked for in memory), and the steps after it."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from grader.rank import memory, probes, rank_timeline
from grader.rank.child import RankContext
from grader.rank.drivers.shared.dtensors import describe
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.recording import MessageJournal, storage_words
from grader.rank.drivers.shared.stub_models import MLP_IN, MLP_OUT, MLPModel
from grader.rank.child import describe_exception

BATCH = 4  # rows per rank and step
STEPS_BEFORE, STEPS_AFTER = 2, 2  # steps before the failure, and after the recovery
LR, WEIGHT_DECAY = 1e-2, 0.01
EPS = 1e-6  # AdamW's: 1e-8 lets float32's rounding of a gradient near 1e-8 move its update by a percent
SEED, WIPE_SEED = 3600, 3601
STALL_TIMEOUT_S = 10.0  # once the model is sharded: a rank that failed must not leave the others waiting
FINGERPRINT_BYTES = 512  # whole tensors smaller than this are not looked for in memory
OPEN_WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
NOT_MESSAGES = ("wait_tensor", "_wrap_tensor_autograd")  # dispatched around collectives, moving nothing


# --- shared by ranks and grader -----------------------------------------------------------------


def layout(world_size: int) -> dict:
    """What one world size grades: (replicas, shards), the replica recovery copies from, the dtype.
    4 ranks: 2 replicas of 2 shards in float64, replica 1 the source (replica 0 wiped); 2 ranks: 2 replicas
    of 1 shard in float32, replica 0 the source. One rank: nothing to recover."""
    shards = 2 if world_size % 2 == 0 and world_size >= 4 else 1
    replicas = world_size // shards
    source = 1 if world_size >= 4 else 0
    return {"replicas": replicas, "shards": shards, "source": source if replicas > 1 else None,
            "wiped": [r for r in range(replicas) if r != source] if replicas > 1 else [],
            "dtype": "float64" if shards > 1 else "float32"}


def build_model(dtype: str) -> MLPModel:
    """The stub's Model (33's), seeded."""
    torch.manual_seed(SEED)
    return MLPModel().to(getattr(torch, dtype))


def make_batch(step: int, rank: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (inputs, targets) at ``step`` (the same at the same step, wherever the job is)."""
    generator = torch.Generator().manual_seed(36_000 + 100 * step + rank)
    x = torch.randn(BATCH, MLP_IN, generator=generator, dtype=torch.float64)
    y = torch.randn(BATCH, MLP_OUT, generator=generator, dtype=torch.float64)
    return x.to(getattr(torch, dtype)), y.to(getattr(torch, dtype))


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


# --- in each rank: what a rank holds and sends ----------------------------------------------------


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _copy(value: torch.Tensor) -> torch.Tensor:
    local = _local(value).detach()
    out = torch.empty(local.shape, dtype=local.dtype)
    out.copy_(local.to("cpu"))
    return out


def training_state(model: nn.Module, optimizer, names: dict[int, str]) -> dict:
    """Every parameter's local values (through the model, as it now is) and the optimizer's state of every
    parameter it steps (by the name the parameter had when the optimizer was built)."""
    params = {name: _copy(p) for name, p in model.named_parameters()}
    state = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optimizer.state.get(p, {})
            state[names.get(id(p), "?")] = {str(k): _copy(v) for k, v in entry.items() if isinstance(v, torch.Tensor)}
    return {"params": params, "state": state}


def state_words(model: nn.Module, optimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """This rank's local state tensors by what they are in words ("'head.weight'", "the exp_avg of 'head.weight'"),
    for the notes of its messages."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p), "?")
            out[repr(name)] = _local(p).detach()
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"the {key} of {name!r}"] = _local(value).detach()
    return out


def _state_tensors(model: nn.Module, optimizer) -> list[torch.Tensor]:
    """The grader's own list of this rank's state tensors (parameters, then each one's optimizer state)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(p)
            out += [v for _, v in sorted(optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor)]
    return out


def fingerprints(model: nn.Module, optimizer, names: dict[int, str]) -> dict[str, bytes]:
    """The bytes of each large parameter and optimizer state whole (DTensor.full_tensor: the grader's own
    all-gathers, on every rank in the same order, outside what is recorded)."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            values = [("", p)] + sorted((f".{k}", v) for k, v in optimizer.state.get(p, {}).items()
                                        if isinstance(v, torch.Tensor) and v.dim())
            for suffix, value in values:
                if value.numel() * value.element_size() >= FINGERPRINT_BYTES and hasattr(value, "full_tensor"):
                    whole = value.detach().full_tensor()
                    out[names[id(p)] + suffix] = memory.tensor_bytes(whole)
                    del whole
    return out


def held(roots: list, learner, prints: dict[str, bytes], when: str) -> dict:
    """The bytes of the distinct storages ``roots`` reach, and the whole tensors found in them."""
    storages = memory.distinct_storages(memory.reachable_tensors(roots, learner.__name__))
    whole = memory.found_in([memory.storage_bytes(s) for s in storages.values()], prints) if prints else []
    return {"when": when, "bytes": sum(s.nbytes() for s in storages.values()), "whole": sorted(whole)}


def _learner_roots(learner) -> list:
    return [value for name, value in vars(learner).items() if not name.startswith("__")]


def _process_group(value):
    try:
        if isinstance(value, str):
            return dist.distributed_c10d._resolve_process_group(value)
        if type(value).__name__ == "ScriptObject":
            return torch._C._distributed_c10d.ProcessGroup.unbox(value)
    except (RuntimeError, ValueError, TypeError):
        pass
    return None


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def describe_message(func, args) -> dict:
    """One dispatched c10d operation: its name, bytes, dtype, its group's global ranks and, for a send or a
    receive, the peer's global rank."""
    name = str(func)
    group = next((g for g in map(_process_group, args) if g is not None), None)
    ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else None
    data = args[0] if args else None
    first = data[0] if isinstance(data, (list, tuple)) and data and isinstance(data[0], torch.Tensor) else data
    event = {"op": name, "bytes": _bytes(data), "group": ranks, "peer": None,
             "dtype": str(first.dtype).removeprefix("torch.") if isinstance(first, torch.Tensor) else None}
    if ("c10d.send" in name or "c10d.recv_" in name) and "any_source" not in name and group is not None:
        with contextlib.suppress(Exception):
            event["peer"] = int(dist.get_global_rank(group, int(args[2])))
    return event


@functools.cache
def _watch_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Messages(TorchDispatchMode):
        """Every c10d operation dispatched (the Python API's, a ProcessGroup's own send and recv, DTensor's
        functional collectives), with a look at memory after each."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # nothing here is compiled: without this the first use imports torch._dynamo

        def __init__(self, events: list, after, note=None):
            super().__init__()
            self.events, self.after, self.note = events, after, note

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            message = func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd") and \
                not any(word in str(func) for word in NOT_MESSAGES)
            event = describe_message(func, args) if message else None
            if event is not None and self.note is not None:
                self.note(event, args)  # before it goes: a message that does not match its peer's aborts the rank
            out = func(*args, **(kwargs or {}))
            if event is not None:
                self.events.append(event)
                self.after(str(func).split(".")[1], [args, out])
            return out

    return Messages


_WRITES: list | None = None  # the list the audit hook appends to while a recovery runs
_AUDIT_ADDED = False
_FILE_WRITER = torch._C.PyTorchFileWriter  # what torch.save writes a path with, from C++ (no audit event)


def _audit(event: str, args: tuple) -> None:
    if _WRITES is None or event not in ("open", "os.rename", "os.replace"):
        return
    try:
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                bool(isinstance(flags, int) and flags & OPEN_WRITE)
            if writing and isinstance(path, (str, bytes, os.PathLike)) and os.fspath(path) != os.devnull:
                _WRITES.append(str(os.fspath(path))[:300])
        else:
            _WRITES.append(str(args[1])[:300])
    except Exception:  # an audit hook that raised would fail the learner's own call
        pass


@contextlib.contextmanager
def watched(events: list, writes: list, saves: list, after, note=None):
    """The watch around the recovery: every c10d operation (``note`` called before each goes, ``after`` after),
    files opened for writing, and the paths torch.save writes (torch.serialization opens an ASCII path in C++,
    which Python's audit events do not see)."""
    global _WRITES, _AUDIT_ADDED
    if not _AUDIT_ADDED:
        sys.addaudithook(_audit)  # for the rest of this process: audit hooks cannot be removed
        _AUDIT_ADDED = True

    def file_writer(target, *args, **kwargs):
        if isinstance(target, (str, bytes, os.PathLike)):
            saves.append(str(os.fspath(target))[:300])
        return _FILE_WRITER(target, *args, **kwargs)

    _WRITES = writes
    torch._C.PyTorchFileWriter = file_writer
    try:
        with _watch_class()(events, after, note):
            yield
    finally:
        _WRITES = None
        torch._C.PyTorchFileWriter = _FILE_WRITER


# --- in each rank: the job -------------------------------------------------------------------------


def describe_mesh(mesh) -> dict:
    out = {"type": type(mesh).__name__}
    if type(mesh).__name__ == "DeviceMesh":
        out.update(device_type=mesh.device_type, shape=list(mesh.shape), names=list(mesh.mesh_dim_names or []),
                   layout=mesh.mesh.tolist())
    return out


def train_step(model: nn.Module, optimizer, step: int, ctx: RankContext, dtype: str) -> None:
    x, y = (t.to(ctx.device) for t in make_batch(step, ctx.rank, dtype))
    loss_of(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _shorten_timeouts(mesh) -> None:
    """From here on a failure is an observation: a peer left waiting raises instead of hanging."""
    groups = [None]
    for name in getattr(mesh, "mesh_dim_names", None) or []:
        with contextlib.suppress(Exception):
            groups.append(mesh.get_group(name))
    for group in groups:
        with contextlib.suppress(Exception):
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S), group)


def _returned(value) -> str | None:
    """None when shard_hybrid returned (module, DeviceMesh); else what it returned, in words."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], nn.Module) and \
            type(value[1]).__name__ == "DeviceMesh":
        return None
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def _set_state(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor, value in zip(tensors, values):
            _local(tensor).copy_(value.to(_local(tensor).device))


def _wipe(tensors: list[torch.Tensor], rank: int) -> None:
    """A replica restarted on new machines: fresh random parameters, AdamW's state zero."""
    generator = torch.Generator().manual_seed(WIPE_SEED * 100 + rank)
    with torch.no_grad():
        for tensor in tensors:
            local = _local(tensor)
            if isinstance(tensor, nn.Parameter):
                local.copy_(0.1 * torch.randn(local.shape, generator=generator, dtype=torch.float64))
            else:
                local.zero_()


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    torch.set_num_threads(1)
    plan = layout(ctx.world_size)
    dtype = plan["dtype"]
    events: list = []
    with ctx.group(), probes.watch_groups(events):
        shard_hybrid, recover_from_peer = ctx.function("shard_hybrid"), ctx.function("recover_from_peer")
        learner = ctx.learner()
        with rank_timeline.region("shard_hybrid"):
            returned = shard_hybrid(build_model(dtype).to(ctx.device), plan["replicas"], plan["shards"])
        obs = {"returned": _returned(returned), "error": None}
        if obs["returned"] is not None:
            return obs
        model, mesh = returned
        obs.update(mesh=describe_mesh(mesh), params={name: describe(p) for name, p in model.named_parameters()},
                   setup_events=[dict(e) for e in events], steps=[], held=[])
        roots = lambda: [model, optimizer] + _learner_roots(learner)  # noqa: E731
        initial = {name: memory.tensor_bytes(p.detach()) for name, p in build_model(dtype).named_parameters()
                   if p.numel() * p.element_size() >= FINGERPRINT_BYTES} if plan["shards"] > 1 else {}
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
        names = {id(p): name for name, p in model.named_parameters()}
        obs["held"].append(held(roots(), learner, initial, "after shard_hybrid"))
        model.register_forward_hook(lambda *_: events.append({"op": "mark", "what": "forward-returned",
                                                               "group": None, "bytes": 0}))
        _shorten_timeouts(mesh)
        for step in range(STEPS_BEFORE):
            first = len(events)
            with rank_timeline.region(f"step {step}"):
                train_step(model, optimizer, step, ctx, dtype)
            obs["steps"].append({"events": [dict(e) for e in events[first:]],
                                 "params": {name: _copy(p) for name, p in model.named_parameters()}})
        if plan["source"] is None:
            return obs
        # The state at the failure; every later look at memory searches for these tensors whole.
        tensors = _state_tensors(model, optimizer)
        snapshot = [_copy(t) for t in tensors]
        prints = fingerprints(model, optimizer, names) if plan["shards"] > 1 else {}
        obs["held"].append(held(roots(), learner, prints, f"after step {STEPS_BEFORE}"))
        obs["before"] = training_state(model, optimizer, names)
        # The replay: the same job without the failure.
        for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            train_step(model, optimizer, step, ctx, dtype)
        obs["replay"] = training_state(model, optimizer, names)
        _set_state(tensors, snapshot)
        obs["wiped"] = ctx.rank // plan["shards"] in plan["wiped"]  # replica r: ranks r * shards ... as stated
        if obs["wiped"]:
            _wipe(tensors, ctx.rank)
        del snapshot
        dist.barrier()  # every replica restored (and the failed one wiped) before any recovery starts
        recovery = {"events": [], "writes": [], "saves": [], "held": [], "error": None, "collectives": []}
        obs["recovery"] = recovery
        # Opened before the watch, which would take the grader's own file for one the recovery writes.
        journal = MessageJournal(ctx.run_dir, ctx.rank)
        name_of = storage_words(state_words(model, optimizer, names))

        def note(event: dict, args) -> None:
            journal.message(event["op"].split(".")[1] if "." in event["op"] else event["op"], event["peer"], args,
                            "recover_from_peer", name_of)

        first = len(events)  # the Python API's collectives too (one run inside a DTensor operation included)

        def look(op: str, extra: list) -> None:
            if not prints or any(h["whole"] for h in recovery["held"]):
                return
            try:
                found = held(roots() + memory.running_locals(os.path.abspath(learner.__file__)) + extra,
                             learner, prints, f"after {op}")
            except Exception as exc:  # the grader's look must never fail the learner's call
                recovery["look_failed"] = f"{type(exc).__name__}: {exc}"[:300]
                return
            if found["whole"]:
                recovery["held"].append(found)

        try:
            with watched(recovery["events"], recovery["writes"], recovery["saves"], look, note), \
                    rank_timeline.region("recover_from_peer"):
                recover_from_peer(model, optimizer, mesh, plan["source"])
            recovery["collectives"] = [dict(e) for e in events[first:]]
            look("recover_from_peer returned", [])
        except NotImplementedError:
            raise
        except Exception as exc:
            recovery["error"] = learner_error(exc)
            recovery["error_record"] = describe_exception(exc, ctx.learner_path)
            return obs
        finally:
            journal.close()
        obs["after"] = training_state(model, optimizer, names)
        dist.barrier()  # every rank's state read before the next step changes it
        try:
            for step in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
                train_step(model, optimizer, step, ctx, dtype)
        except Exception as exc:  # e.g. parameters the recovery replaced by others of another shape
            obs["error"] = learner_error(exc)
            return obs
        obs["resumed"] = training_state(model, optimizer, names)
        return obs
