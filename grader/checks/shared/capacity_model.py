"""The transformer of :mod:`grader.capacity`, written out for one rank of a parallel plan (runs in a rank).

GPT-style, untied head without bias: token and position embeddings; L layers of LayerNorm, fused
QKV, explicit attention (QK^T scaled, softmax, dropout on the probabilities, x V), out projection,
dropout, residual, LayerNorm, fc1, exact GELU, fc2, dropout, residual; final LayerNorm and head.

Megatron's tensor parallelism: QKV and fc1 split by output features (weights and biases), out and
fc2 by input features (biases whole, added after the reduction), LayerNorms, embeddings, the final
norm and the head whole on every tensor rank; the conjugate operators f (identity forward, all-reduce
backward) before QKV and fc1, g (all-reduce forward, identity backward) after out and fc2.

Functional: parameters are plain leaf tensors in a dict, so that :mod:`.capacity_run` can lay them
out in flat buffers (ZeRO) without nn.Module in the way. Dropout is ``torch.native_dropout``, whose
backward keeps a 1-byte mask (``F.dropout`` on the CPU keeps a mask in the activations' dtype and
its input too). The attention scores are one ``baddbmm`` with alpha = 1/sqrt(d), as in Megatron.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LAYER_NAMES = ("ln1_w", "ln1_b", "qkv_w", "qkv_b", "out_w", "out_b",
               "ln2_w", "ln2_b", "fc1_w", "fc1_b", "fc2_w", "fc2_b")
INIT_STD = 0.02


def full_parameters(model: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model in float32, the same on every rank (one generator, one order)."""
    h, V, s = model["hidden"], model["vocab"], model["seq_len"]
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=gen) * INIT_STD

    out = {"tok_emb": normal(V, h), "pos_emb": normal(s, h)}
    for i in range(model["layers"]):
        shapes = {"qkv_w": (3 * h, h), "qkv_b": (3 * h,), "out_w": (h, h), "out_b": (h,),
                  "fc1_w": (4 * h, h), "fc1_b": (4 * h,), "fc2_w": (h, 4 * h), "fc2_b": (h,)}
        for name in LAYER_NAMES:
            if name.startswith("ln"):
                out[f"layers.{i}.{name}"] = (torch.ones(h) if name.endswith("_w") else torch.zeros(h)) \
                    + normal(h)
            else:
                out[f"layers.{i}.{name}"] = normal(*shapes[name])
    out["lnf_w"], out["lnf_b"] = torch.ones(h) + normal(h), normal(h)
    out["head_w"] = normal(V, h)
    return out


def tp_slice(name: str, value: torch.Tensor, model: dict, tp: int, tp_index: int) -> torch.Tensor:
    """This tensor rank's part of one parameter of a layer (Megatron's split)."""
    if tp == 1:
        return value
    h, a = model["hidden"], model["heads"]
    short = name.rsplit(".", 1)[-1]
    if short in ("qkv_w", "qkv_b"):  # (3, heads, head_dim, ...): this rank's heads of each of Q, K, V
        shaped = value.reshape(3, a, h // a, *value.shape[1:])
        local = a // tp
        return shaped[:, tp_index * local:(tp_index + 1) * local].reshape(3 * h // tp, *value.shape[1:])
    if short in ("fc1_w", "fc1_b"):
        return value.chunk(tp, dim=0)[tp_index]
    if short in ("out_w", "fc2_w"):
        return value.chunk(tp, dim=1)[tp_index]
    return value  # LayerNorms, out's and fc2's biases


def local_parameters(model: dict, plan: dict, coords: tuple[int, int, int], seed: int) -> list:
    """[(name, float32 tensor)] of this rank in flat-buffer order: embeddings (first stage), its stage's
    layers [stage * L/p, (stage + 1) * L/p) split for its tensor rank, final norm and head (last stage)."""
    stage, _, tp_index = coords
    full = full_parameters(model, seed)
    per_stage = model["layers"] // plan["pp"]
    out = []
    if stage == 0:
        out += [("tok_emb", full["tok_emb"]), ("pos_emb", full["pos_emb"])]
    for i in range(stage * per_stage, (stage + 1) * per_stage):
        for name in LAYER_NAMES:
            key = f"layers.{i}.{name}"
            out.append((key, tp_slice(key, full[key], model, plan["tp"], tp_index).contiguous()))
    if stage == plan["pp"] - 1:
        out += [("lnf_w", full["lnf_w"]), ("lnf_b", full["lnf_b"]), ("head_w", full["head_w"])]
    return out


# --- tensor-parallel conjugate operators -------------------------------------------------------------


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient over the tensor group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: all-reduce of the partial sums over the tensor group forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)  # x is the fresh output of the row-parallel matmul (Megatron's _reduce)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --- the layer ---------------------------------------------------------------------------------------


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
    """QK^T / sqrt(d), softmax, dropout on the probabilities, x V; q, k, v are (batch x heads, s, d)."""
    scores = torch.baddbmm(torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=q.dtype), q,
                           k.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(q.shape[-1]))
    probs = F.softmax(scores, dim=-1)
    probs = dropout_(probs, dropout)
    return torch.bmm(probs, v)


def dropout_(x: torch.Tensor, p: float) -> torch.Tensor:
    if p <= 0:
        return x
    return torch.native_dropout(x, p, True)[0]


class Layer:
    """One transformer layer's forward on one tensor rank; ``params`` maps LAYER_NAMES to tensors."""

    def __init__(self, params: dict, heads: int, tp_group, tp: int, dropout: float, recompute: str):
        self.p, self.tp_group, self.tp = params, tp_group, tp
        self.local_heads = heads // tp
        self.dropout, self.recompute = dropout, recompute

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":
            return checkpoint(self.forward, x, use_reentrant=True)
        return self.forward(x)

    def f(self, x):
        return CopyToTensorParallel.apply(x, self.tp_group) if self.tp > 1 else x

    def g(self, x):
        return ReduceFromTensorParallel.apply(x, self.tp_group) if self.tp > 1 else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        b, s, h = x.shape
        heads, d = self.local_heads, h // (self.local_heads * self.tp)
        y = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"])
        qkv = F.linear(self.f(y), p["qkv_w"], p["qkv_b"])  # column-parallel: this rank's heads
        qkv = qkv.view(b, s, 3, heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = (t.reshape(b * heads, s, d) for t in qkv)
        if self.recompute == "selective":
            core = checkpoint(attention_core, q, k, v, self.dropout, use_reentrant=True)
        else:
            core = attention_core(q, k, v, self.dropout)
        core = core.view(b, heads, s, d).transpose(1, 2).reshape(b, s, heads * d)
        out = self.g(F.linear(core, p["out_w"])) + p["out_b"]  # row-parallel: reduce, then the whole bias
        x = x + dropout_(out, self.dropout)
        y = F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"])
        hidden = F.gelu(F.linear(self.f(y), p["fc1_w"], p["fc1_b"]))
        out = self.g(F.linear(hidden, p["fc2_w"])) + p["fc2_b"]
        return x + dropout_(out, self.dropout)


def embed(params: dict, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1])
    return F.embedding(tokens, params["tok_emb"]) + F.embedding(positions, params["pos_emb"])


def head_loss(params: dict, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1]
    logits = F.linear(F.layer_norm(x, (h,), params["lnf_w"], params["lnf_b"]), params["head_w"])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
