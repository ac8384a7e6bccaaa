"""Exercise 41, right, another style: an inventory of every tensor rank 0 holds and every tensor a layer
saves, each with its size and whether tensor parallelism splits it, summed at the end."""


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


MASK = "mask"  # one byte an element whatever the precision


def parameter_tensors(m: ModelSpec, plan: Plan):
    """(name, elements, split over tp?) for every parameter of rank 0's stage."""
    h, V, s = m.hidden, m.vocab, m.seq_len
    first, last = True, plan.pp == 1
    if first:
        yield "tokens.weight", V * h, False
        yield "positions.weight", s * h, False
    for i in range(m.layers // plan.pp):
        yield f"layers.{i}.norm1", 2 * h, False
        yield f"layers.{i}.qkv.weight", 3 * h * h, True
        yield f"layers.{i}.qkv.bias", 3 * h, True
        yield f"layers.{i}.out.weight", h * h, True
        yield f"layers.{i}.out.bias", h, False
        yield f"layers.{i}.norm2", 2 * h, False
        yield f"layers.{i}.fc1.weight", 4 * h * h, True
        yield f"layers.{i}.fc1.bias", 4 * h, True
        yield f"layers.{i}.fc2.weight", 4 * h * h, True
        yield f"layers.{i}.fc2.bias", h, False
    if last:
        yield "norm", 2 * h, False
        yield "head.weight", h * V, False


def saved_tensors(m: ModelSpec, plan: Plan):
    """(name, elements, split over tp?, dtype) that one layer keeps for one micro-batch."""
    sbh, a_ss = plan.micro_batch * m.seq_len * m.hidden, plan.micro_batch * m.heads * m.seq_len ** 2
    if plan.recompute == "full":
        yield "layer input", sbh, False, "act"
        return
    yield "norm1 input", sbh, False, "act"
    yield "qkv input", sbh, False, "act"
    yield "q, k, v", 3 * sbh, True, "act"
    if plan.recompute == "none":
        yield "softmax output", a_ss, True, "act"
        yield "attention dropout mask", a_ss, True, MASK
        yield "dropped-out probabilities", a_ss, True, "act"
    yield "out input", sbh, True, "act"
    yield "dropout mask after out", sbh, False, MASK
    yield "norm2 input", sbh, False, "act"
    yield "fc1 input", sbh, False, "act"
    yield "gelu input", 4 * sbh, True, "act"
    yield "fc2 input", 4 * sbh, True, "act"
    yield "dropout mask after fc2", sbh, False, MASK


def validate(m: ModelSpec, plan: Plan) -> None:
    problems = []
    if min(m.layers, m.hidden, m.heads, m.vocab, m.seq_len) < 1:
        problems.append("every model size must be positive")
    if min(plan.dp, plan.tp, plan.pp, plan.micro_batch, plan.micro_batches) < 1:
        problems.append("every plan size must be positive")
    elif m.layers % plan.pp:
        problems.append(f"pp={plan.pp} does not divide {m.layers} layers")
    if plan.tp >= 1 and (m.heads % plan.tp or m.hidden % m.heads):
        problems.append(f"tp={plan.tp} does not divide {m.heads} heads (hidden {m.hidden})")
    if plan.zero not in range(4) or (plan.zero >= 2 and plan.pp > 1):
        problems.append(f"ZeRO {plan.zero} with pp={plan.pp}")
    if plan.schedule not in {"gpipe", "1f1b"} or plan.precision not in {"bf16-mixed", "fp32"} \
            or plan.recompute not in {"none", "selective", "full"}:
        problems.append("unknown schedule, precision or recompute")
    if problems:
        raise ValueError("; ".join(problems))


def training_memory(model: ModelSpec, plan: Plan) -> MemoryBreakdown:
    validate(model, plan)
    width = {"act": 2 if plan.precision == "bf16-mixed" else 4, MASK: 1}
    P = sum(n // plan.tp if split else n for _, n, split in parameter_tensors(model, plan))
    shard = -(-P // plan.dp)
    held = {stage: (shard if plan.zero >= stage else P) for stage in (1, 2, 3)}
    if plan.precision == "bf16-mixed":
        params, grads, optimizer = 2 * held[3], 2 * held[2], (4 + 4 + 4) * held[1]
    else:
        params, grads, optimizer = 4 * held[3], 4 * held[2], (4 + 4) * held[1]
    per_layer = sum(width[kind] * (n // plan.tp if split else n) for _, n, split, kind in saved_tensors(model, plan))
    if plan.schedule == "gpipe":
        live = plan.micro_batches
    else:
        live = min(plan.pp, plan.micro_batches)
    activations = per_layer * (model.layers // plan.pp) * live
    return MemoryBreakdown(params=params, grads=grads, optimizer=optimizer, activations=activations,
                           total=params + grads + optimizer + activations)
