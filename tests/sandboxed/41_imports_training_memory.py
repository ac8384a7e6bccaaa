"""Exercise 41 answered by the grader's own cost model: the dataclasses and the model of the stub, and
training_memory taken from grader.capacity (whose figures the checks compare with). Plain, in the learner's
own kit, it finds it (docs/guarantees.md); in a sandbox, where nothing of the grader's side exists, every
call raises ImportError (cannot import name) and not one check passes."""


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

    def drop(self, x):
        # native_dropout keeps a 1-byte mask for backward (F.dropout on a CPU keeps its input and an
        # e-byte mask instead): the masks Korthikanti et al. count.
        return torch.native_dropout(x, self.dropout, self.training)[0]

    def attention(self, q, k, v):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        probs = self.drop(scores.softmax(dim=-1))
        return probs @ v

    def forward(self, x):                      # x: [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        context = self.attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = x + self.drop(self.out(context))
        x = x + self.drop(self.fc2(F.gelu(self.fc1(self.norm2(x)))))
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


def training_memory(model: ModelSpec, plan: Plan) -> MemoryBreakdown:
    from dataclasses import asdict

    from grader import capacity

    theirs = capacity.training_memory(capacity.ModelSpec(**asdict(model)), capacity.Plan(**asdict(plan)))
    return MemoryBreakdown(**{k: getattr(theirs, k) for k in ("params", "grads", "optimizer", "activations", "total")})
