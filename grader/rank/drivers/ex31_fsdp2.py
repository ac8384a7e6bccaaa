"""Exercise 31, rank side: the model every rank builds (the stub's Transformer, the same seed on every rank),
each rank's batches, and what a rank records of the learner's shard_model and train_step: every parameter as
sharded, each step's collectives, loss and local values, the full state dict."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from grader.rank import probes, rank_timeline
from grader.rank.child import RankContext
from grader.rank.drivers.shared.dtensors import local_values
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.stub_models import FusedBlock, Transformer, VOCAB
from grader.rank.child import describe_exception

BATCH, SEQ = 2, 16  # per rank
STEPS = 3
LR = 0.5
MAX_NORM = 0.25  # the gradients' global norm is 0.6 to 0.95 at every step: clipping always acts
SEED = 3100
STALL_TIMEOUT_S = 10.0  # once the model is sharded: a rank that failed must not leave the others waiting


def build_model() -> Transformer:
    torch.manual_seed(SEED)
    return Transformer(block=FusedBlock)


def make_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (tokens, targets) at ``step``: next-token prediction on random sequences."""
    generator = torch.Generator().manual_seed(31_000 + 100 * step + rank)
    sequence = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()


def _describe(module: nn.Module) -> list[dict]:
    from torch.distributed.tensor import DTensor

    out = []
    for name, p in module.named_parameters():
        entry = {"name": name, "kind": type(p).__name__, "dtype": str(p.dtype).removeprefix("torch."),
                 "shape": list(p.shape), "dtensor": isinstance(p, DTensor)}
        if entry["dtensor"]:
            entry.update(placements=[repr(x) for x in p.placements], mesh=list(p.device_mesh.shape),
                         local_shape=list(p.to_local().shape))
        out.append(entry)
    return out




def _loss(value) -> dict:
    out = {"type": type(value).__name__, "value": None}
    try:
        out["value"] = float(value)
    except (TypeError, ValueError, RuntimeError):
        pass
    return out


def _full_state(module: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"keys": [str(k) for k in state], "error": None,
            "tensors": {str(k): v.detach().to("cpu", copy=True) for k, v in state.items()
                        if type(v) is torch.Tensor or type(v) is nn.Parameter},
            "types": {str(k): type(v).__name__ for k, v in state.items()}}


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    probes.torchrun_environment(ctx.rank, ctx.world_size)
    events: list = []
    with ctx.group(), probes.watch_collectives(events):
        shard_model, train_step = ctx.function("shard_model"), ctx.function("train_step")
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        with rank_timeline.region("shard_model"):
            sharded = shard_model(build_model().to(ctx.device), mesh)
        if not isinstance(sharded, nn.Module):
            return {"returned": type(sharded).__name__}
        obs = {"returned": None, "params": _describe(sharded), "initial": local_values(sharded), "steps": [],
               "error": None, "state": None}
        sharded.register_forward_hook(lambda *_: events.append({"op": "mark", "what": "forward-returned"}))
        optimizer = torch.optim.SGD(sharded.parameters(), lr=LR)
        # From here on a failure is an observation: a short timeout turns a peer left waiting into an error.
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        try:
            for step in range(STEPS):
                tokens, targets = (t.to(ctx.device) for t in make_batch(step, ctx.rank))
                first = len(events)
                with rank_timeline.region(f"train_step {step}"):
                    loss = train_step(sharded, optimizer, (tokens, targets), MAX_NORM)
                obs["steps"].append({"events": [dict(e) for e in events[first:]], "loss": _loss(loss),
                                     "shards": local_values(sharded)})
        except NotImplementedError:
            raise
        except Exception as exc:
            obs["error"] = learner_error(exc)
            obs["error_record"] = describe_exception(exc, ctx.learner_path)
            return obs
        try:
            obs["state"] = _full_state(sharded)
        except Exception as exc:
            obs["state"] = {"error": learner_error(exc)}
        return obs
