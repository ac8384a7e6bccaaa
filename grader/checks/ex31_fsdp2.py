"""Exercise 31: shard_model and train_step with torch's FSDP2 (fully_shard, MixedPrecisionPolicy).

Rank side, one run per world size: every rank builds the grader's Transformer (the stub's
model, the same seed on every rank), calls the learner's shard_model on a 1-D DeviceMesh of
all the ranks, and records each parameter as it then is (DTensor or not, placements, mesh,
local shape, dtype) and its local values. Then three steps of train_step with the grader's
SGD on each rank's own batch, recording after each: every collective of the step (the probe's
events, each with the dtype it sent, and a mark where the model's forward returned), the returned loss and the local values of every parameter. Last, the full state
dict from torch.distributed.checkpoint (full_state_dict=True, cpu_offload=True: on rank 0).
An exception in train_step or in the state dict is recorded, under a short collective
timeout, so that what was seen before it can still be judged.

Grader side: the same model replayed in one process in the same precision (parameters cast
to bfloat16 for each rank's batch, gradients averaged in float32, clipped to the global norm,
SGD), compared with every rank's shards after each step; the rest from the records
(ex31_verdicts holds the verdicts).
"""

from __future__ import annotations

import copy
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from grader import probes
from grader.checks import ex31_verdicts as verdicts
from grader.checks.interface import Grader, RankContext
from grader.checks.shared.dtensors import local_values
from grader.checks.shared.learner_errors import learner_error
from grader.child import describe_exception

VOCAB, DIM, LAYERS, HEADS, HIDDEN = 96, 32, 3, 4, 96
BATCH, SEQ = 2, 16  # per rank
STEPS = 3
LR = 0.5
MAX_NORM = 0.25  # the gradients' global norm is 0.6 to 0.95 at every step: clipping always acts
SEED = 3100
STALL_TIMEOUT_S = 10.0  # once the model is sharded: a rank that failed must not leave the others waiting


# --- the model: the stub's, kept here so that the learner's file cannot change it -----------------


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.n_heads = n_heads
        self.attention_norm = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.wqkv(self.attention_norm(x)).view(batch, seq, 3, self.n_heads, dim // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attention.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS,
                 hidden: int = HIDDEN):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# --- shared by ranks and grader -------------------------------------------------------------------


def build_model() -> Transformer:
    torch.manual_seed(SEED)
    return Transformer()


def make_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (tokens, targets) at ``step``: next-token prediction on random sequences."""
    generator = torch.Generator().manual_seed(31_000 + 100 * step + rank)
    sequence = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()


# --- in each rank: the driver ---------------------------------------------------------------------


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


def rank_main(ctx: RankContext) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    probes.torchrun_environment(ctx.rank, ctx.world_size)
    events: list = []
    with ctx.group(), probes.watch_collectives(events):
        shard_model, train_step = ctx.function("shard_model"), ctx.function("train_step")
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
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


# --- in the grader: the single process in the same precision ---------------------------------------


def reference_run(world_size: int) -> dict:
    """One process: each step, the float32 model cast to bfloat16 for each rank's batch (as the gathered
    parameters are), the gradients averaged in float32, clipped to MAX_NORM by their norm, SGD.

    Returns the initial state, the state after each step, each step's gradient norm before clipping,
    and each rank's loss at each step.
    """
    model = build_model()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    states, norms, losses = [], [], []
    for step in range(STEPS):
        low = copy.deepcopy(model).to(torch.bfloat16)
        grads = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        step_losses = []
        for rank in range(world_size):
            low.zero_grad()
            tokens, targets = make_batch(step, rank)
            loss = loss_fn(low(tokens), targets)
            loss.backward()
            step_losses.append(loss.item())
            for name, p in low.named_parameters():
                grads[name] += p.grad.float()
        grads = {name: g / world_size for name, g in grads.items()}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        scale = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= LR * scale * grads[name]
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        norms.append(float(norm))
        losses.append(step_losses)
    return {"initial": initial, "states": states, "norms": norms, "losses": losses, "lr": LR, "max_norm": MAX_NORM,
            "batch": BATCH}


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        observations = g.run(rank_main, world_size).results()
        returned = next((o["returned"] for o in observations if o.get("returned")), None)
        if returned is not None:
            g.stop(f"shard_model returned {returned}, not the module: fully_shard shards the model in place; "
                   "return it", world_size=world_size)
        model = build_model()
        verdicts.check_placements(g, observations, world_size, model)
        if not verdicts.check_no_error(g, observations, world_size):
            continue
        if world_size > 1:  # one rank gathers nothing: its shard is the whole parameter
            verdicts.check_units(g, observations, world_size,
                                 verdicts.unit_sizes(observations[0]["params"], model, world_size))
        verdicts.check_dtypes(g, observations, world_size)
        reference = reference_run(world_size)
        verdicts.check_clipping(g, observations, reference, world_size)
        verdicts.check_training(g, observations, reference, world_size)
        verdicts.check_loss(g, observations, reference, world_size)
        verdicts.check_state_dict(g, observations, reference, world_size)
    if max(g.world_sizes) == 1:
        for check_id in ("block-units", "fp32-reduce", "global-clip"):
            g.skip(check_id, "needs a world size of 2 or more: one rank gathers and reduces nothing, its shards "
                   "are the whole model")
