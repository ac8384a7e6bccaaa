"""Exercise 34, rank side: the model (the stub's), the layout every rank and the grader share, and the driver."""

from __future__ import annotations

import contextlib
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from grader.rank import memory, probes, rank_timeline
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.stub_models import PIPE_DIM, PIPE_VOCAB, PipelineModel
from grader.rank.child import RankContext

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
SEQ, ROWS = 4, 2  # each micro-batch: ROWS sequences of SEQ tokens
STEPS = 3
LR = 0.5
SEED = 3400
STALL_TIMEOUT_S = 10.0  # once the pipeline is built, for collectives (gloo's point-to-point waits keep the group's own)


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "Interleaved1F1B" else 1


def n_layers(world_size: int) -> int:
    return 2 * world_size  # two blocks per stage for GPipe and 1F1B, one for the interleaved schedule


def n_microbatches(world_size: int) -> int:
    return 2 * world_size  # more than the stages of GPipe and 1F1B: there the two schedules differ


def build_model(schedule: str, world_size: int) -> PipelineModel:
    torch.manual_seed(SEED + 10 * world_size + SCHEDULES.index(schedule))
    return PipelineModel(n_layers=n_layers(world_size)).double()


def make_batch(schedule: str, world_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one step: (tokens, targets), n_microbatches * ROWS sequences of SEQ tokens."""
    g = torch.Generator().manual_seed(34_000 + 100 * world_size + 10 * SCHEDULES.index(schedule) + step)
    rows = n_microbatches(world_size) * ROWS
    return torch.randint(0, PIPE_VOCAB, (rows, SEQ), generator=g), torch.randint(0, PIPE_VOCAB, (rows, SEQ), generator=g)


def stage_of(name: str, num_stages: int, world_size: int) -> int:
    """The stage that holds the model's parameter ``name``: contiguous slices of the blocks, the
    embeddings in the first stage and the head in the last."""
    if name.startswith("tok_embeddings."):
        return 0
    if name.startswith("output."):
        return num_stages - 1
    return int(name.split(".")[1]) // (n_layers(world_size) // num_stages)


def stages_of_rank(schedule: str, rank: int, world_size: int) -> list[int]:
    """Looped: rank r holds stages r, r + W, ..."""
    return [rank + k * world_size for k in range(stages_per_rank(schedule))]


def activation_bytes() -> int:
    """One micro-batch's activation between two stages (and its gradient): ROWS x SEQ x PIPE_DIM float64."""
    return ROWS * SEQ * PIPE_DIM * 8


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class StageWatch:
    """Every PipelineStage built, and every forward and backward one ran, in this rank.

    ``live`` counts, per (stage, micro-batch), the tensors autograd saved in that forward and still
    holds: backward frees them, so the most keys alive at once is what the schedule keeps in memory.
    """

    def __init__(self):
        self.built: list = []
        self.actions: list[tuple[str, int, int]] = []
        self.live: dict[tuple[int, int], int] = {}
        self.peak = 0

    def reset(self) -> None:
        self.actions, self.live, self.peak = [], {}, 0

    def _released(self, key) -> None:
        self.live[key] -= 1

    def _pack(self, key):
        def pack(tensor):
            saved = _Saved(tensor)
            self.live[key] = self.live.get(key, 0) + 1
            weakref.finalize(saved, self._released, key)
            self.peak = max(self.peak, sum(1 for n in self.live.values() if n > 0))
            return saved
        return pack

    @contextlib.contextmanager
    def installed(self):
        from torch.distributed.pipelining.stage import _PipelineStageBase

        init, forward, backward = (_PipelineStageBase.__init__, _PipelineStageBase.forward_one_chunk,
                                   _PipelineStageBase.backward_one_chunk)
        watch = self

        def observed_init(stage, *args, **kwargs):
            init(stage, *args, **kwargs)
            watch.built.append(stage)

        def observed_forward(stage, chunk, *args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(stage, chunk, *args, **kwargs)
            key = (int(stage.stage_index), int(chunk))
            watch.actions.append(("F", *key))
            with rank_timeline.phase("forward", f"F{key[1]} s{key[0]}"), \
                    torch.autograd.graph.saved_tensors_hooks(watch._pack(key), _unpack):
                return forward(stage, chunk, *args, **kwargs)

        def observed_backward(stage, chunk, *args, **kwargs):
            watch.actions.append(("B", int(stage.stage_index), int(chunk)))
            with rank_timeline.phase("backward", f"B{int(chunk)} s{int(stage.stage_index)}"):
                return backward(stage, chunk, *args, **kwargs)

        with probes.patched(_PipelineStageBase, "__init__", observed_init), \
                probes.patched(_PipelineStageBase, "forward_one_chunk", observed_forward), \
                probes.patched(_PipelineStageBase, "backward_one_chunk", observed_backward):
            yield self


def _unpack(saved: _Saved):
    return saved.tensor


def _loss(value) -> dict:
    out = {"type": type(value).__name__, "value": None}
    try:
        out["value"] = float(value)
    except (TypeError, ValueError, RuntimeError):
        pass
    return out


def _found(roots: list, learner, prints: dict[str, bytes]) -> list[str]:
    """The model's parameters whose values lie in a storage reachable from ``roots``."""
    storages = memory.distinct_storages(memory.reachable_tensors(roots, learner.__name__))
    return sorted(memory.found_in([memory.storage_bytes(s) for s in storages.values()], prints))


def _values(modules) -> dict:
    return {f"{i}/{name}": p.detach().to("cpu", copy=True)
            for i, module in enumerate(modules) for name, p in module.named_parameters()}


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    events: list = []
    watch = StageWatch()
    with ctx.group(), probes.watch_collectives(events), watch.installed():
        build_pipeline, train_step = ctx.function("build_pipeline"), ctx.function("train_step")
        out = {}
        for schedule in SCHEDULES:
            with rank_timeline.region(schedule):
                out[schedule] = obs = _one_schedule(ctx, schedule, build_pipeline, train_step, events, watch)
            if obs.get("error") or obs.get("returned"):
                break  # a peer may still wait on this rank's messages: the next schedule would meet them
        return out


def _one_schedule(ctx: RankContext, schedule: str, build_pipeline, train_step, events: list, watch) -> dict:
    rank, world_size = ctx.rank, ctx.world_size
    model = build_model(schedule, world_size).to(ctx.device)
    prints = {name: memory.tensor_bytes(p) for name, p in model.named_parameters()}
    watch.built = []
    first = len(events)
    returned = build_pipeline(model, rank, world_size, n_microbatches(world_size), schedule, ctx.device)
    del model  # from here on, only what the learner keeps holds the model
    if not (isinstance(returned, tuple) and len(returned) == 2):
        return {"returned": f"a {type(returned).__name__}, not a (schedule, stage_modules) pair"}
    pipeline, modules = returned
    modules = list(modules) if isinstance(modules, (list, tuple, nn.ModuleList)) else [modules]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        return {"returned": "stage_modules that is not a list of nn.Module"}
    learner = ctx.learner()
    obs = {"returned": None, "build_events": [dict(e) for e in events[first:]],
           "held": _found([pipeline, modules, vars(learner)], learner, prints),
           "stages": [{"index": int(s.stage_index), "num_stages": int(s.num_stages),
                       "holds": _found([s.submod], learner, prints)} for s in watch.built],
           "initial": _values(modules), "steps": [], "error": None}
    optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
    try:
        for step in range(STEPS):
            tokens, targets = (t.to(ctx.device) for t in make_batch(schedule, world_size, step))
            first = len(events)
            watch.reset()
            loss = train_step(pipeline, tokens, targets, rank, world_size, optimizer)
            obs["steps"].append({"events": [dict(e) for e in events[first:]], "actions": list(watch.actions),
                                 "peak_live": watch.peak, "loss": _loss(loss), "params": _values(modules)})
    except NotImplementedError:
        raise
    except Exception as exc:
        obs["error"] = learner_error(exc)
    return obs
