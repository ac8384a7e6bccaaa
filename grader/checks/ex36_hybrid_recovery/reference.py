"""Exercise 36, grader side: one process training the model on every rank's batch at once (AdamW written out
as torch's single-tensor AdamW computes it, in float64), and what each rank should hold of the model."""

from __future__ import annotations

import math

import torch

from grader.rank.drivers.ex36_hybrid_recovery import (EPS, LR, STEPS_AFTER, STEPS_BEFORE, WEIGHT_DECAY,
                                                     build_model, loss_of, make_batch)

BETAS = (0.9, 0.999)
STEP_BYTES = 4  # AdamW's step count: a float32 scalar per parameter


def reference_run(world_size: int) -> dict:
    """The parameters after each of the job's steps (before the failure and after it), trained in one process
    on the mean of every rank's loss: what averaging the gradients over every rank of every replica gives."""
    model = build_model("float64")
    params = dict(model.named_parameters())
    moments = {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in params.items()}
    states = []
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        model.zero_grad(set_to_none=True)
        for rank in range(world_size):
            x, y = make_batch(step, rank, "float64")
            (loss_of(model(x), y) / world_size).backward()
        beta1, beta2 = BETAS
        with torch.no_grad():
            for name, p in params.items():
                exp_avg, exp_avg_sq = moments[name]
                p.mul_(1 - LR * WEIGHT_DECAY)
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** (step + 1))).add_(EPS)
                p.addcdiv_(exp_avg, denom, value=-LR / (1 - beta1 ** (step + 1)))
        states.append({name: p.detach().clone() for name, p in params.items()})
    initial = build_model("float64")
    return {"initial": {name: p.detach() for name, p in initial.named_parameters()}, "states": states}


def shapes() -> dict[str, list[int]]:
    return {name: list(p.shape) for name, p in build_model("float64").named_parameters()}


def rows(shape: list[int], shards: int, shard: int) -> int:
    """Rows of a parameter of ``shape`` that shard ``shard`` holds: its torch.chunk of dim 0."""
    per = math.ceil(shape[0] / shards) if shape else 1
    return max(0, min(per, (shape[0] if shape else 1) - shard * per))


def local_shape(shape: list[int], shards: int, shard: int) -> list[int]:
    return [rows(shape, shards, shard)] + list(shape[1:]) if shape else []


def held_limit(shards: int, itemsize: int, with_optimizer: bool) -> int:
    """The bytes a rank holds at most with 1 / shards of every parameter (FSDP2 pads each shard to the
    largest one's rows) and, ``with_optimizer``, AdamW's two moments of its shard and its step counts."""
    total = 0
    for shape in shapes().values():
        padded = math.ceil(shape[0] / shards) * math.prod(shape[1:]) * itemsize
        total += padded * (3 if with_optimizer else 1) + (STEP_BYTES if with_optimizer else 0)
    return total


def unit_elements(shards: int) -> dict:
    """What one all-gather of each block, and of the root's own parameters, brings to each rank of a replica,
    in elements of the local input it sends (FSDP2 pads each parameter's rows to a multiple of shards)."""
    padded = {name: math.ceil(shape[0] / shards) * math.prod(shape[1:]) for name, shape in shapes().items()}
    blocks = sorted({name.split(".")[1] for name in padded if name.startswith("blocks.")}, key=int)
    return {"blocks": [sum(v for n, v in padded.items() if n.startswith(f"blocks.{b}.")) for b in blocks],
            "root": sum(v for n, v in padded.items() if not n.startswith("blocks.")),
            "root_names": [n for n in padded if not n.startswith("blocks.")]}
