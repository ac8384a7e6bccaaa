"""Exercise 41: napkin math, part 1: how many bytes each GPU needs to train a transformer.

"A 70B model on 1,024 H100s: how do you shard it, and does it fit?" Answer it with a
function, and the grader holds your function against what real training runs measure.

    training_memory(model: ModelSpec, plan: Plan) -> MemoryBreakdown

Bytes held by rank 0 (the first pipeline stage, tensor-parallel rank 0, data-parallel
rank 0) for the transformer below, trained with Adam under `plan`:

  params       the parameters that compute: 2 bytes each under "bf16-mixed", 4 under "fp32"
  grads        their gradients, same element size, as kept between backward and the step
  optimizer    Adam's exp_avg and exp_avg_sq (4 + 4 bytes, fp32), plus the fp32 master
               copy of the weights under "bf16-mixed" (4 more)
  activations  what the transformer layers keep for backward at the step's peak
  total        the sum of the four

The plan (all sizes at least 1; the world size is dp * tp * pp):
  - tensor parallelism over tp ranks splits each layer as Megatron-LM does: QKV and
    fc1 by output features (weight and bias), out and fc2 by input features (their
    biases stay whole), both LayerNorms whole. The embeddings, the final norm and the
    head stay whole on every tensor-parallel rank (Megatron-LM splits them over the
    vocabulary; the kit keeps them whole, which keeps its runs small).
  - pipeline parallelism over pp stages: stage i holds layers [i*L/pp, (i+1)*L/pp);
    the first stage also the two embeddings, the last the final norm and the head.
  - ZeRO over the dp ranks of a stage: each rank's local parameters form one flat
    buffer, padded to a multiple of dp; a sharded quantity keeps ceil(P / dp)
    elements of it. Stage 1 shards the optimizer state, 2 the gradients too, 3 the
    parameters too (resident bytes: buffers gathered for a moment are not counted).
  - activations: one micro-batch is micro_batch sequences of seq_len tokens. Each
    layer keeps, with e the element size (2 or 4 bytes) and dropout masks 1 byte
    per element, what Korthikanti et al. (2022) count: the inputs of both norms,
    of QKV, of out, of fc1 and fc2, GELU's input, Q, K and V, the softmax output,
    its dropout mask and the dropped-out probabilities, and the two dropout masks
    after out and fc2. Under tensor parallelism, whatever a layer computes on its
    own slice of heads or features is that slice only.
    recompute "selective" recomputes the attention core (QK^T, softmax, dropout,
    times V) in backward, so its tensors of size heads x seq x seq are not kept;
    "full" recomputes whole layers and keeps each layer's input only.
    A stage holds the activations of every micro-batch in flight at its peak:
    "gpipe" runs all micro_batches forwards before any backward, with one stage
    too (all micro_batches held); "1f1b" holds at most as many as there are stages
    from this one to the last (and never more than micro_batches).
  - A plan that cannot run raises ValueError saying why: pp not dividing layers,
    tp not dividing heads, ZeRO 2 or 3 together with pp > 1 (this exercise's rule),
    an unknown schedule, precision or recompute, a size below 1.

This is the GPT-style transformer and the plans of 2019-2021. Frontier runs add
grouped-query attention, SwiGLU, RMSNorm, sequence and context parallelism,
interleaved and uneven pipeline stages, ZeRO 2 and 3 with pipeline stages and
experts; each changes what a count counts, not how you count, so the exercise
leaves them out to stay an hour's work. Once 41 and 42 pass, `ddp-grade plan`
costs them too, and `ddp-grade plan --published` holds the kit's model to published
runs: Llama 3 405B's plans among them (docs/capacity.md).

Grade it:  ddp-grade exercises/41_memory.py
The grader trains the transformer below for real on 2 to 4 processes under a dozen
plans and compares each term with what each rank holds (exactly for params, grads
and optimizer; activations within 1.5 %: LayerNorm's saved statistics are the
only thing the count above leaves out), and checks your figures at scale against
the ZeRO paper's (7.5B parameters on 64 GPUs) and Korthikanti et al.'s.
"""

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


def check(model: ModelSpec, plan: Plan) -> None:
    for name in ("layers", "hidden", "heads", "vocab", "seq_len"):
        if getattr(model, name) < 1:
            raise ValueError(f"model.{name} must be at least 1, not {getattr(model, name)}")
    for name in ("dp", "tp", "pp", "micro_batch", "micro_batches"):
        if getattr(plan, name) < 1:
            raise ValueError(f"plan.{name} must be at least 1, not {getattr(plan, name)}")
    if model.hidden % model.heads:
        raise ValueError(f"hidden {model.hidden} is not divisible by {model.heads} heads")
    if model.layers % plan.pp:
        raise ValueError(f"{plan.pp} pipeline stages do not divide {model.layers} layers")
    if model.heads % plan.tp:
        raise ValueError(f"tensor-parallel size {plan.tp} does not divide {model.heads} heads")
    if plan.zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, not {plan.zero}")
    if plan.zero >= 2 and plan.pp > 1:
        raise ValueError(f"ZeRO stage {plan.zero} cannot be combined with {plan.pp} pipeline stages")
    if plan.schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"unknown schedule {plan.schedule!r}")
    if plan.precision not in ("bf16-mixed", "fp32"):
        raise ValueError(f"unknown precision {plan.precision!r}")
    if plan.recompute not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute {plan.recompute!r}")


def training_memory(model: ModelSpec, plan: Plan) -> MemoryBreakdown:
    check(model, plan)
    L, h, a, V, s = model.layers, model.hidden, model.heads, model.vocab, model.seq_len
    t, b = plan.tp, plan.micro_batch

    # 1. Rank 0's parameters: its layers' slices, plus the embeddings on the first stage.
    per_layer = 12 * h * h // t + 7 * h // t + 6 * h    # split matrices and biases; norms, out/fc2 biases whole
    count = L // plan.pp * per_layer + V * h + s * h
    if plan.pp == 1:
        count += 2 * h + h * V                            # the final norm and the head live on the last stage

    # 2. Model states: element sizes, then ZeRO's shard of a flat buffer padded to a multiple of dp.
    e = 2 if plan.precision == "bf16-mixed" else 4
    adam = 12 if plan.precision == "bf16-mixed" else 8   # m and v, plus the fp32 master copy under mixed
    shard = math.ceil(count / plan.dp)
    params = e * (shard if plan.zero >= 3 else count)
    grads = e * (shard if plan.zero >= 2 else count)
    optimizer = adam * (shard if plan.zero >= 1 else count)

    # 3. Activations of one layer and one micro-batch (Korthikanti et al. 2022, table 2).
    if plan.recompute == "full":
        layer = e * s * b * h
    else:
        layer = (4 * e + 2) * s * b * h + 12 * e * s * b * h // t
        if plan.recompute == "none":
            layer += (2 * e + 1) * a * s * s * b // t
    in_flight = plan.micro_batches if plan.schedule == "gpipe" else min(plan.pp, plan.micro_batches)
    activations = L // plan.pp * layer * in_flight

    return MemoryBreakdown(params, grads, optimizer, activations, params + grads + optimizer + activations)
