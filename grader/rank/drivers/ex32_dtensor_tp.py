"""Exercise 32, rank side: the model every rank builds (the stub's Transformer, the same seed everywhere), the
batches, what a rank records of the learner's parallelize and of three training steps, and a watch on the
process group of every collective."""

from __future__ import annotations

import contextlib
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.tensor import DTensor

from grader.rank import probes, rank_timeline
from grader.rank.drivers.shared.dtensors import describe, local_values
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.stub_models import Block, Transformer, VOCAB, lm_loss
from grader.rank.child import describe_exception
from grader.rank.child import RankContext

BATCH, SEQ = 2, 16  # per data-parallel group
STEPS = 3
LR = 0.5
SEED = 3200
STALL_TIMEOUT_S = 10.0  # once the model is built: a rank that failed must not leave the others waiting


def tp_size_for(world_size: int) -> int:
    """The tensor-parallel size graded at ``world_size``: 2 where it divides the world, else 1."""
    return 2 if world_size % 2 == 0 else 1


def build_model() -> Transformer:
    torch.manual_seed(SEED)
    return Transformer(block=Block)


def make_batch(step: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel group ``group``'s (tokens, targets) at ``step``: next-token prediction."""
    generator = torch.Generator().manual_seed(32_000 + 100 * step + group)
    sequence = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()


# --- what a rank records -----------------------------------------------------------------------------




def describe_mesh(mesh) -> dict:
    out = {"type": type(mesh).__name__}
    if type(mesh).__name__ != "DeviceMesh":
        return out
    out.update(device_type=mesh.device_type, shape=list(mesh.shape), names=list(mesh.mesh_dim_names or []),
               layout=mesh.mesh.tolist())
    return out






def describe_error(exc: BaseException, learner_path: str) -> dict:
    """The exception, the torch API it came from (the innermost of device_mesh, parallelize_module,
    fully_shard on its stack) and the learner's line that called it."""
    frames = traceback.extract_tb(exc.__traceback__)
    stage, line = None, None
    for frame in frames:
        path = frame.filename.replace("\\", "/")
        if frame.filename == learner_path:
            line = f"{os.path.basename(learner_path)} line {frame.lineno}: {(frame.line or '').strip()}"
        elif "/distributed/tensor/parallel/" in path and stage in (None, "device_mesh"):
            stage = "parallelize_module"
        elif "/distributed/fsdp/" in path and stage in (None, "device_mesh"):
            stage = "fully_shard"
        elif path.endswith("/distributed/device_mesh.py") and stage is None:
            stage = "device_mesh"
    return {"error": f"{type(exc).__name__}: {exc}"[:600], "stage": stage, "line": line}


def _norm_recorder(seen: dict, name: str):
    def hook(module, args):
        if name not in seen and args and isinstance(args[0], torch.Tensor):
            seen[name] = describe(args[0])
    return hook


def _shorten_timeouts(mesh) -> None:
    """From here on a failure is an observation: a peer left waiting raises instead of hanging."""
    groups = [None]
    for name in getattr(mesh, "mesh_dim_names", None) or []:
        with contextlib.suppress(Exception):
            groups.append(mesh.get_group(name))
    for group in groups:
        with contextlib.suppress(Exception):
            c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S), group)


def _loss_value(loss) -> float:
    if isinstance(loss, DTensor):
        loss = loss.to_local() if all(p.is_replicate() for p in loss.placements) else loss.full_tensor()
    return float(loss.detach())


def train_step(model: nn.Module, optimizer, tokens: torch.Tensor, targets: torch.Tensor):
    """One step as the statement says: logits, loss_fn (under loss_parallel when the logits are a
    DTensor), backward, SGD, gradients cleared. Returns the logits and the loss."""
    logits = model(tokens)
    if isinstance(logits, DTensor):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = lm_loss(logits, targets)
            loss.backward()
    else:
        loss = lm_loss(logits, targets)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return logits, loss


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    tp_size = ctx.kwargs["tp_size"]
    events: list = []
    with ctx.group(), probes.watch_groups(events):
        parallelize = ctx.function("parallelize")
        obs = {"returned": None, "parallelize_error": None, "device_type": ctx.device.type}
        try:
            with rank_timeline.region("parallelize"):
                returned = parallelize(build_model().to(ctx.device), ctx.world_size, tp_size)
        except NotImplementedError:
            raise
        except Exception as exc:
            obs["parallelize_error"] = describe_error(exc, ctx.learner_path)
            return obs
        if not (isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[0], nn.Module)):
            obs["returned"] = type(returned).__name__ + (f" of {len(returned)}" if isinstance(returned, tuple) else "")
            return obs
        model, mesh = returned
        obs.update(mesh=describe_mesh(mesh), setup_events=[dict(e) for e in events], error=None, steps=[],
                   params={name: describe(p) for name, p in model.named_parameters()},
                   initial=local_values(model), norms={}, output=None)
        hooks = [m.register_forward_pre_hook(_norm_recorder(obs["norms"], name))
                 for name, m in model.named_modules() if isinstance(m, nn.RMSNorm)]
        # Where each step's forward ends in its events: what comes before is what one forward sends.
        model.register_forward_hook(lambda *_: events.append({"op": "mark", "what": "forward-returned",
                                                               "via": None, "group": None, "bytes": 0}))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        _shorten_timeouts(mesh)
        try:
            for step in range(STEPS):
                tokens, targets = (t.to(ctx.device) for t in make_batch(step, ctx.rank // tp_size))
                first = len(events)
                with rank_timeline.region(f"step {step}"):
                    logits, loss = train_step(model, optimizer, tokens, targets)
                record = {"events": [dict(e) for e in events[first:]], "loss": _loss_value(loss),
                          "locals": local_values(model)}
                if step == 0:
                    for hook in hooks:
                        hook.remove()
                    local = logits.to_local() if isinstance(logits, DTensor) else logits
                    obs["output"] = {**describe(logits), "local": local.detach().to("cpu", copy=True)}
                obs["steps"].append(record)
        except NotImplementedError:
            raise
        except Exception as exc:
            obs["error"] = learner_error(exc)
            obs["error_record"] = describe_exception(exc, ctx.learner_path)
        return obs
