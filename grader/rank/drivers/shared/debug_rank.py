"""The debugging track, rank side: run a learner's script as torchrun would, and record what it did.

:func:`run_job` sets the variables torchrun sets, installs probes, imports the script and calls
``main(["--data", ..., "--out", ..., "--epochs", ...])``; what the probes record is described in
:mod:`grader.checks.shared.debug_job`, which reads it in the grader.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from grader.rank import probes, rank_timeline
from grader.rank.drivers.shared.recording import cpu_state
from grader.rank.drivers.shared.stub_models import JOB_VOCAB
from grader.rank.child import RankContext

COLLECTIVE_WAIT_S = 6.0  # a collective whose peers have not come after this long is a hang
LOG_NAME = "log.jsonl"  # what rank 0 of every script appends to in --out, one JSON object per line


# --- in each rank ---------------------------------------------------------------------


def write_shared(path: str, obj, rank: int) -> None:
    """Every rank writes the same ``obj`` to ``path``: through a file of its own, renamed onto it.

    The rename is atomic, so a rank that reads ``path`` after its own write sees a whole file
    whichever rank's copy it is, and the ranks need not wait for each other.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    own = f"{path}.rank{rank}"
    torch.save(obj, own)
    os.replace(own, path)


def run_job(ctx: RankContext, argv: list[str], *, epochs: int) -> dict:
    """Call the learner's ``main(argv + [--out, --epochs])`` in this rank, under the probes."""
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    out_dir = os.path.join(ctx.run_dir, "out")
    os.makedirs(out_dir, exist_ok=True)
    argv = [*argv, "--out", out_dir, "--epochs", str(epochs)]
    watch = _JobWatch()
    started = time.monotonic()
    raised = None
    with rank_timeline.recording() as recorder, probes.platform_start_method(), watch:
        main = ctx.function("main")
        try:
            main(argv)
        except BaseException as exc:  # the symptom, when it is an exception: recorded, not re-raised
            raised = describe(exc, ctx.learner_path, started)
    return {
        "events": watch.events,
        "ddp": watch.settings,
        "first_states": [cpu_state(m) if s is None else s for m, s in zip(watch.modules, watch.first_states)],
        "final_states": [cpu_state(m) for m in watch.modules],
        "trained": watch.trained_index(),
        "raised": raised,
        "initialized_after": dist.is_initialized(),
        "seconds": time.monotonic() - started,
        "timeline": recorder.snapshot(),
    }


def describe(exc: BaseException, learner_path: str, started: float) -> dict:
    """An exception from ``main`` as data: type, message, the script's line, the collective it waited in."""
    from grader.rank.child import describe_exception

    info = describe_exception(exc, learner_path)
    info["after_s"] = time.monotonic() - started
    info["waiting_in"] = waiting_in(exc)
    return info


_COLLECTIVE_NAMES = set(probes.COLLECTIVES) | set(probes.POINT_TO_POINT) | {"monitored_barrier", "wait"}


def waiting_in(exc: BaseException) -> str:
    """The collective the exception came out of: "all_reduce", "barrier" ..., "backward" for the
    gradient all-reduce DDP runs inside loss.backward(), "" when neither."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/distributed/" in path and frame.name in _COLLECTIVE_NAMES:
            return frame.name
    for frame in reversed(frames):
        path = frame.filename.replace("\\", "/")
        if "/torch/autograd/" in path or (path.endswith("torch/_tensor.py") and frame.name == "backward"):
            return "backward"
        if "/torch/nn/parallel/distributed.py" in path and frame.name == "forward":
            return "forward"
    return ""


class _JobWatch:
    """The probes of one job, installed before the script is imported."""

    def __init__(self):
        self.events: list = []
        self.settings: list[dict] = []
        self.modules: list[nn.Module] = []
        self.first_states: list = []
        self.forwards: list[int] = []
        self._undo: list = []

    def trained_index(self) -> int | None:
        """The DDP model that ran the most training forwards (the last one built on a tie)."""
        if not self.modules:
            return None
        return max(range(len(self.modules)), key=lambda i: (self.forwards[i], i))

    def __enter__(self):
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        watch = self
        events = self.events
        loaders: dict[int, list] = {}  # id(loader) -> [index, passes so far]

        original_ddp_init = DistributedDataParallel.__init__

        def ddp_init(ddp, module, *args, **kwargs):
            original_ddp_init(ddp, module, *args, **kwargs)
            watch._wrap(ddp, module)

        original_iter = DataLoader.__iter__

        def loader_iter(loader):
            it = original_iter(loader)
            entry = loaders.setdefault(id(loader), [len(loaders), 0])
            entry[1] += 1
            try:
                it._ddp_grade_pass = (entry[0], entry[1] - 1)
            except AttributeError:
                pass
            return it

        original_next = _BaseDataLoaderIter.__next__

        def loader_next(it):
            batch = original_next(it)
            tag = getattr(it, "_ddp_grade_pass", None)
            if tag is not None:
                events.append({"what": "batch", "loader": tag[0], "pass": tag[1]})
            return batch

        original_init_pg = c10d.init_process_group

        def init_process_group(*args, **kwargs):
            result = original_init_pg(*args, **kwargs)
            # A wait this long in a collective is a hang: gloo raises there, naming the collective.
            timeout = kwargs.get("timeout")
            seconds = COLLECTIVE_WAIT_S if timeout is None else min(COLLECTIVE_WAIT_S, timeout.total_seconds())
            c10d._set_pg_timeout(timedelta(seconds=seconds))
            return result

        for owner, name, value in ((DistributedDataParallel, "__init__", ddp_init), (DataLoader, "__iter__", loader_iter),
                                   (_BaseDataLoaderIter, "__next__", loader_next),
                                   (c10d, "init_process_group", init_process_group),
                                   (dist, "init_process_group", init_process_group)):
            patch = probes.patched(owner, name, value)
            patch.__enter__()
            self._undo.append(patch)
        def record_step(optimizer, args, kwargs):
            groups = getattr(optimizer, "param_groups", None) or [{}]
            lr = groups[0].get("lr")
            events.append({"what": "step", "lr": float(lr) if isinstance(lr, (int, float)) else None})

        self._step_hook = register_optimizer_step_post_hook(record_step)
        self._collectives = probes.watch_collectives(events)
        self._collectives.__enter__()
        return self

    def __exit__(self, *exc):
        self._collectives.__exit__(None, None, None)
        self._step_hook.remove()
        while self._undo:
            self._undo.pop().__exit__(None, None, None)

    def _wrap(self, ddp, module: nn.Module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        index = len(self.modules)
        self.modules.append(module)
        self.first_states.append(None)
        self.forwards.append(0)
        self.settings.append({
            "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
            "static_graph": bool(getattr(ddp, "static_graph", False)),
            "broadcast_buffers": bool(getattr(ddp, "broadcast_buffers", True)),
        })
        events = self.events

        def record_forward(mod, args):
            if not torch.is_grad_enabled():
                return
            if self.first_states[index] is None:  # where training starts, after any checkpoint was loaded
                self.first_states[index] = cpu_state(mod)
            self.forwards[index] += 1
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            events.append({"what": "forward", "ddp": index,
                           "x": None if x is None else x.detach().to("cpu", copy=True)})

        def record_sync(state, bucket):
            events.append({"what": "sync", "ddp": index, "bucket": int(bucket.index()),
                           "no_sync": not ddp.require_backward_grad_sync})
            mark = len(events)
            future = default_hooks.allreduce_hook(None, bucket)
            for event in events[mark:]:
                event["grader"] = True  # the hook's own all_reduce, not the script's
            return future

        module.register_forward_pre_hook(record_forward)
        ddp.register_comm_hook(None, record_sync)


# --- the inputs, and the driver of a job that reads only its data file ------------------------------


def make_data(seed: int, n_train: int, n_val: int, features: int = 16, classes: int = 4) -> dict:
    """A small classification problem (a random linear teacher), as the scripts' --data file holds it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_train + n_val, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(dim=1)
    return {"train_x": x[:n_train], "train_y": y[:n_train], "val_x": x[n_train:], "val_y": y[n_train:]}


def write_data(ctx: RankContext, data: dict) -> str:
    path = os.path.join(ctx.run_dir, "inputs", "data.pt")
    write_shared(path, data, ctx.rank)
    return path


def job_driver(make_data, epochs: int):
    """The rank-side driver of a job that reads only its data file: ``rank_main = job_driver(make_data, EPOCHS)``."""

    def rank_main(ctx: RankContext) -> dict:
        return run_job(ctx, ["--data", write_data(ctx, make_data())], epochs=epochs)

    return rank_main


# --- the FSDP2 jobs' data file (28 and up) ------------------------------------------------------------

JOB_SEQ = 8  # tokens a sample reads (and JOB_SEQ next tokens it predicts)
JOB_SAMPLES = 48  # 2 ranks: 6 steps an epoch; 3 ranks: 4


def job_tokens(seed: int) -> dict:
    """The data file of an FSDP2 job (28 and up): JOB_SAMPLES sequences of tokens, and the next token of each."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, JOB_VOCAB, (JOB_SAMPLES, JOB_SEQ + 1), generator=g)
    return {"train_x": tokens[:, :-1].contiguous(), "train_y": tokens[:, 1:].contiguous()}
