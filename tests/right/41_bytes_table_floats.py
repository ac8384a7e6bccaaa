"""Exercise 41, right, another style: bytes per parameter from a table, float arithmetic throughout,
dataclasses.replace for the terms and a dict of the ZeRO stages' divisors."""


import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    layers: int      # L
    hidden: int      # h
    heads: int       # a
    vocab: int       # V
    seq_len: int     # s


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0                  # ZeRO stage 0-3 over the data-parallel ranks
    micro_batch: int = 1           # b: sequences per micro-batch
    micro_batches: int = 1         # m: micro-batches per step on each data-parallel rank
    schedule: str = "1f1b"         # "gpipe" or "1f1b"
    precision: str = "bf16-mixed"  # or "fp32"
    recompute: str = "none"        # "none", "selective" or "full"


@dataclass
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    activations: float
    total: float


# The transformer the grader trains (here in one process; every tensor it keeps is visible).

class Layer(nn.Module):
    def __init__(self, spec: ModelSpec, dropout: float = 0.1):
        super().__init__()
        h = spec.hidden
        self.heads, self.dropout = spec.heads, dropout
        self.norm1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.out = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def attention(self, q, k, v):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        probs = F.dropout(scores.softmax(dim=-1), self.dropout, self.training)
        return probs @ v

    def forward(self, x):                      # x: [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        context = self.attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.out(context), self.dropout, self.training)
        x = x + F.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x)))), self.dropout, self.training)
        return x


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.positions = nn.Embedding(spec.seq_len, spec.hidden)
        self.layers = nn.ModuleList(Layer(spec) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)

    def forward(self, tokens):                 # tokens: [b, s] -> logits [b, s, V]
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


BYTES = {  # precision -> (param, grad, optimizer) bytes per parameter
    "bf16-mixed": (2.0, 2.0, 12.0),
    "fp32": (4.0, 4.0, 8.0),
}
SHARDED = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


def training_memory(model: ModelSpec, plan: Plan) -> MemoryBreakdown:
    assert_ok = [
        (model.layers % plan.pp == 0, "the stages must divide the layers"),
        (model.heads % plan.tp == 0, "tp must divide the heads"),
        (plan.zero in SHARDED, "ZeRO stage 0-3"),
        (not (plan.zero >= 2 and plan.pp > 1), "no ZeRO 2/3 with a pipeline"),
        (plan.schedule in ("gpipe", "1f1b"), "schedule"),
        (plan.precision in BYTES, "precision"),
        (plan.recompute in ("none", "selective", "full"), "recompute"),
        (min(plan.dp, plan.tp, plan.pp, plan.micro_batch, plan.micro_batches) >= 1, "sizes >= 1"),
    ]
    for ok, why in assert_ok:
        if not ok:
            raise ValueError(f"impossible plan {plan}: {why}")

    L, h, a, V, s = (float(x) for x in (model.layers, model.hidden, model.heads, model.vocab, model.seq_len))
    t, b, p = float(plan.tp), float(plan.micro_batch), float(plan.pp)
    n = (L / p) * (12 * h * h / t + 7 * h / t + 6 * h) + V * h + s * h + (2 * h + h * V if plan.pp == 1 else 0.0)
    n_shard = float(math.ceil(round(n) / plan.dp))
    per_param = dict(zip(("params", "grads", "optimizer"), BYTES[plan.precision]))
    terms = {k: v * (n_shard if k in SHARDED[plan.zero] else n) for k, v in per_param.items()}

    e = per_param["params"]
    if plan.recompute == "full":
        layer = e * s * b * h
    else:
        layer = s * b * h * (4 * e + 2 + 12 * e / t)
        if plan.recompute == "none":
            layer += (2 * e + 1) * a * s * s * b / t
    live = float(plan.micro_batches) if plan.schedule == "gpipe" else float(min(plan.pp, plan.micro_batches))
    out = MemoryBreakdown(**terms, activations=layer * (L / p) * live, total=0.0)
    return dataclasses.replace(out, total=out.params + out.grads + out.optimizer + out.activations)
