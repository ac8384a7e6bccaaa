"""The transformer of the kit's cost model (``grader.capacity``), written out for one rank of a parallel plan
(runs in a rank).

GPT-style by default (41-43's): token and position embeddings; L layers of LayerNorm, fused QKV, explicit
attention (QK^T scaled, softmax, dropout on the probabilities, x V), out projection, dropout, residual,
LayerNorm, fc1, exact GELU, fc2, dropout, residual; final LayerNorm and an untied head without bias. The
frontier options of the cost model's ``ModelSpec`` change what the names say: grouped-query attention (K and V
heads repeated to every head for explicit attention, kept as they are by flash attention), SwiGLU (fc1 is
[gate; up]), RMSNorm, no biases, RoPE, no dropout, mixture-of-experts MLPs (tp 1).

Megatron's tensor parallelism: QKV and fc1 split by output features (weights and biases), out and fc2 by
input features (biases whole, added after the reduction), norms, embeddings, the final norm and the head
whole on every tensor rank unless ``vocab_parallel`` splits the last two over the vocabulary; the conjugate
operators f (identity forward, all-reduce backward) before QKV and fc1, g (all-reduce forward, identity
backward) after out and fc2, or under sequence parallelism :mod:`.capacity_parallel`'s gather and scatter.

Functional: parameters are plain leaf tensors in a dict, so that :mod:`.capacity_run` can lay them out in
flat buffers (ZeRO) without nn.Module in the way. Dropout is ``torch.native_dropout``, whose backward
keeps a 1-byte mask. The attention scores are one ``baddbmm`` with alpha = 1/sqrt(d), as in Megatron.

The model and the plan arrive as the grader's plain data (every field of the cost model's ``ModelSpec`` and
``Plan``) with what the grader derived from them, its ``layout`` (K and V heads, MLP widths, the
mixture-of-experts layers, each pipeline rank's chunks of layers and its schedule): the cost model itself is
the grader's, never in a rank.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from grader.rank.drivers.shared import capacity_parallel as par

INIT_STD = 0.02


Spec = SimpleNamespace  # ModelSpec's fields; kv (K and V heads), ffn_width, expert_width, moe_layers derived
PlanView = SimpleNamespace  # Plan's fields; chunks[stage] (each chunk's layers) and order[stage] derived


def spec_of(model: dict, layout: dict) -> Spec:
    """The model as the grader sent it, with what it derived (``layout``)."""
    return SimpleNamespace(**model, kv=layout["kv_heads"], ffn_width=layout["ffn"], expert_width=layout["expert_ffn"],
                           moe_layers=frozenset(layout["moe_layers"]))


def plan_of(plan: dict, layout: dict) -> PlanView:
    """The plan as the grader sent it; ``chunks[stage]``: the layers of each of that pipeline rank's chunks,
    ``order[stage]``: its schedule, [("F" or "B", micro-batch, chunk)]."""
    return SimpleNamespace(**{**plan, "stage_layers": tuple(plan.get("stage_layers") or ())},
                           chunks=[[list(c) for c in stage] for stage in layout["chunks"]],
                           order=[[(op, int(j), int(c)) for op, j, c in stage] for stage in layout["order"]])


# --- parameters ------------------------------------------------------------------------------------------


def layer_shapes(spec: Spec, layer: int) -> dict:
    """Name -> shape of every parameter of one layer, whole (before any split), in flat-buffer order."""
    h, d = spec.hidden, spec.hidden // spec.heads
    qkv, f = (spec.heads + 2 * spec.kv) * d, spec.ffn_width
    u = 2 if spec.mlp == "swiglu" else 1
    norm = lambda name: {f"{name}_w": (h,), **({f"{name}_b": (h,)} if spec.norm == "layernorm" else {})}  # noqa: E731
    bias = lambda name, *shape: {name: shape} if spec.bias else {}  # noqa: E731
    shapes = {**norm("ln1"), "qkv_w": (qkv, h), **bias("qkv_b", qkv), "out_w": (h, h), **bias("out_b", h),
              **norm("ln2")}
    if not layer in spec.moe_layers:
        return {**shapes, "fc1_w": (u * f, h), **bias("fc1_b", u * f), "fc2_w": (h, f), **bias("fc2_b", h)}
    e, E = spec.expert_width, spec.experts
    shapes.update({"router_w": (E, h), "experts_w1": (E, h, u * e), **bias("experts_b1", E, u * e),
                   "experts_w2": (E, e, h), **bias("experts_b2", E, h)})
    for j in range(spec.shared_experts):
        shapes.update({f"shared{j}_fc1_w": (u * e, h), **bias(f"shared{j}_fc1_b", u * e), f"shared{j}_fc2_w": (h, e),
                       **bias(f"shared{j}_fc2_b", h)})
    return shapes


def full_parameters(spec: Spec, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model in float32, the same on every rank (one generator, one order)."""
    h, V, s = spec.hidden, spec.vocab, spec.seq_len
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=gen) * INIT_STD

    out = {"tok_emb": normal(V, h)}
    if spec.positions == "learned":
        out["pos_emb"] = normal(s, h)
    for i in range(spec.layers):
        for name, shape in layer_shapes(spec, i).items():
            if name.startswith("ln"):
                out[f"layers.{i}.{name}"] = (torch.ones(h) if name.endswith("_w") else torch.zeros(h)) + normal(h)
            else:
                out[f"layers.{i}.{name}"] = normal(*shape)
    out["lnf_w"] = torch.ones(h) + normal(h)
    if spec.norm == "layernorm":
        out["lnf_b"] = normal(h)
    out["head_w"] = normal(V, h)
    return out


def tp_slice(name: str, value: torch.Tensor, spec: Spec, tp: int, tp_index: int) -> torch.Tensor:
    """This tensor rank's part of one parameter (Megatron's split; vocabulary rows for the embedding and head)."""
    if tp == 1:
        return value
    short = name.rsplit(".", 1)[-1]
    if short in ("qkv_w", "qkv_b"):  # this rank's heads of each of Q, K and V
        d = spec.hidden // spec.heads
        a, kv = spec.heads, spec.kv
        q, k, v = value.split([a * d, kv * d, kv * d], dim=0)
        return torch.cat([part.chunk(tp, dim=0)[tp_index] for part in (q, k, v)])
    if short.endswith(("fc1_w", "fc1_b")):  # swiglu: this rank's rows of the gate and of up
        parts = value.chunk(2 if spec.mlp == "swiglu" else 1, dim=0)
        return torch.cat([part.chunk(tp, dim=0)[tp_index] for part in parts])
    if short.endswith(("out_w", "fc2_w")):
        return value.chunk(tp, dim=1)[tp_index]
    if short in ("tok_emb", "head_w"):  # only under vocab_parallel (the caller says)
        return value.chunk(tp, dim=0)[tp_index]
    return value  # norms, out's and fc2's biases


def local_buffers(spec: Spec, p: PlanView, coords: tuple, seed: int) -> list[dict]:
    """This rank's flat buffers, in order: for each chunk its dense parameters ({"chunk", "kind": "dense",
    "params": [(name, float32 tensor)]}) and, when it holds experts, theirs ("kind": "expert")."""
    stage, dp_index, _, tp_index = coords
    full = full_parameters(spec, seed)
    chunks = p.chunks[stage]
    out = []
    for c, layers in enumerate(chunks):
        dense, expert = [], []
        if stage == 0 and c == 0:
            tok = full["tok_emb"]
            dense.append(("tok_emb", tp_slice("tok_emb", tok, spec, p.tp, tp_index) if p.vocab_parallel else tok))
            if spec.positions == "learned":
                dense.append(("pos_emb", full["pos_emb"]))
        for i in layers:
            for name in layer_shapes(spec, i):
                key, value = f"layers.{i}.{name}", full[f"layers.{i}.{name}"]
                if name.startswith("experts_"):
                    local = spec.experts // p.ep
                    expert.append((key, value[dp_index % p.ep * local:(dp_index % p.ep + 1) * local].contiguous()))
                else:
                    dense.append((key, tp_slice(key, value, spec, p.tp, tp_index).contiguous()))
        if stage == p.pp - 1 and c == len(chunks) - 1:
            dense += [(n, full[n]) for n in ("lnf_w", "lnf_b") if n in full]
            head = full["head_w"]
            dense.append(("head_w", tp_slice("head_w", head, spec, p.tp, tp_index) if p.vocab_parallel else head))
        out.append({"chunk": c, "kind": "dense", "params": dense})
        if expert:
            out.append({"chunk": c, "kind": "expert", "params": expert})
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
    """One transformer layer's forward on one rank; ``params`` maps layer_shapes' names to tensors."""

    def __init__(self, params: dict, spec: Spec, plan: PlanView, groups: dict, index: int,
                 dropout: float, cp_index: int = 0):
        self.p, self.spec, self.plan, self.index = params, spec, plan, index
        self.tp, self.tp_group = plan.tp, groups.get("tp", (None, None))[0]
        self.cp_group = groups.get("cp", (None, None))[0]
        self.ep_group = groups.get("ep", (None, None))[0]
        self.local_heads, self.local_kv = spec.heads // plan.tp, spec.kv // plan.tp
        self.dropout = dropout if spec.dropout else 0.0
        self.recompute = plan.recompute
        self.cp_index = cp_index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":
            return checkpoint(self.forward, x, use_reentrant=True)
        return self.forward(x)

    def norm(self, x, name):
        if self.spec.norm == "rmsnorm":
            return par.RMSNorm.apply(x, self.p[f"{name}_w"])
        return F.layer_norm(x, (x.shape[-1],), self.p[f"{name}_w"], self.p[f"{name}_b"])

    def column(self, y, name):
        weight, bias = self.p[f"{name}_w"], self.p.get(f"{name}_b")
        if self.tp > 1 and self.plan.sp:
            return par.GatherLinear.apply(y, weight, bias, self.tp_group)
        if self.tp > 1:
            y = CopyToTensorParallel.apply(y, self.tp_group)
        return F.linear(y, weight, bias)

    def row(self, x, name):
        out = F.linear(x, self.p[f"{name}_w"])
        if self.tp > 1 and self.plan.sp:
            out = par.ScatterReduce.apply(out, self.tp_group)
        elif self.tp > 1:
            out = ReduceFromTensorParallel.apply(out, self.tp_group)
        bias = self.p.get(f"{name}_b")
        return out + bias if bias is not None else out  # row-parallel: reduce, then the whole bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x, "ln1")
        qkv = self.column(y, "qkv")  # column-parallel: this rank's heads
        context = self.attention(qkv)
        x = x + dropout_(self.row(context, "out"), self.dropout)
        y = self.norm(x, "ln2")
        out = self.moe(y) if self.index in self.spec.moe_layers else self.mlp(y, "fc1", "fc2")
        return x + dropout_(out, self.dropout)

    def attention(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, _ = qkv.shape
        heads, kv = self.local_heads, self.local_kv
        d = self.spec.hidden // self.spec.heads
        qkv = qkv.view(b, s, heads + 2 * kv, d)
        if self.spec.positions == "rope":  # the angles of this context rank's tokens (made here: a rank keeps no tensor)
            tables = par.rotary_tables(torch.arange(self.cp_index * s, (self.cp_index + 1) * s), d)
            qkv = par.Rotary.apply(qkv, *tables, heads + kv)
        if self.plan.attention == "flash" and self.plan.cp > 1 and self.plan.cp_comm == "ring":
            return par.RingFlashAttention.apply(qkv, heads, kv, self.cp_group)
        if self.plan.attention == "flash":
            return par.FlashAttention.apply(qkv, heads, kv, self.cp_group if self.plan.cp > 1 else None)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + kv], qkv[:, :, heads + kv:]
        if kv < heads:  # explicit attention repeats K and V to every head
            k, v = k.repeat_interleave(heads // kv, dim=2), v.repeat_interleave(heads // kv, dim=2)
        q, k, v = (t.permute(0, 2, 1, 3).reshape(b * heads, s, d) for t in (q, k, v))
        if self.recompute == "selective":
            core = checkpoint(attention_core, q, k, v, self.dropout, use_reentrant=True)
        else:
            core = attention_core(q, k, v, self.dropout)
        return core.view(b, heads, s, d).transpose(1, 2).reshape(b, s, heads * d)

    def mlp(self, y: torch.Tensor, first: str, second: str) -> torch.Tensor:
        hidden = self.column(y, first)
        if self.spec.mlp == "swiglu":
            gate, up = hidden.chunk(2, dim=-1)
            return self.row(F.silu(gate) * up, second)
        return self.row(F.gelu(hidden), second)

    def moe(self, y: torch.Tensor) -> torch.Tensor:
        """Top-k routing with each expert's slots (capacity) per rank, dispatch and combine over the expert
        group, then the shared experts (tp 1)."""
        spec, plan = self.spec, self.plan
        b, s, h = y.shape
        E, k, n = spec.experts, spec.top_k, b * s
        slots = math.ceil(plan.capacity_factor * n * k / E)
        tokens = y.reshape(n, h)
        probs = torch.softmax(F.linear(tokens, self.p["router_w"]).float(), dim=-1)
        gates, chosen = probs.topk(k, dim=-1)
        with torch.no_grad():  # each choice's slot: first choices first (GShard), past the capacity dropped
            order = chosen.t().reshape(-1)
            position = (F.one_hot(order, E).cumsum(0) - 1).gather(1, order[:, None]).squeeze(1)
            slot = torch.where(position < slots, order * slots + position, E * slots).view(k, n).t()
            source = torch.full((E * slots + 1,), n, dtype=torch.long)
            source[slot.reshape(-1)] = torch.arange(n).repeat_interleave(k)
            source = source[:-1].clone()  # an index of E x slots
        rows = torch.cat([tokens, tokens.new_zeros(1, h)])[source]  # (E x slots, h), empty slots zero
        if plan.ep > 1:
            rows = par.AllToAll.apply(rows, self.ep_group)
        local = E // plan.ep
        inputs = rows.view(plan.ep, local, slots, h).transpose(0, 1).reshape(local, plan.ep * slots, h)
        hidden = torch.bmm(inputs, self.p["experts_w1"])
        if "experts_b1" in self.p:
            hidden = hidden + self.p["experts_b1"][:, None]
        if spec.mlp == "swiglu":
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(hidden)
        out = torch.bmm(hidden, self.p["experts_w2"])
        if "experts_b2" in self.p:
            out = out + self.p["experts_b2"][:, None]
        out = out.view(local, plan.ep, slots, h).transpose(0, 1).reshape(E * slots, h)
        if plan.ep > 1:
            out = par.AllToAll.apply(out, self.ep_group)
        picked = torch.cat([out, out.new_zeros(1, h)])[slot.reshape(-1)]  # (n x k, h), dropped choices zero
        combined = (picked * gates.reshape(-1, 1).to(picked.dtype)).view(n, k, h).sum(dim=1)
        for j in range(spec.shared_experts):
            combined = combined + self.mlp(tokens, f"shared{j}_fc1", f"shared{j}_fc2")
        return combined.view(b, s, h)


# --- embeddings and head -------------------------------------------------------------------------------


class Ends:
    """The first chunk's embeddings and the last chunk's norm, head and loss on one rank."""

    def __init__(self, params: dict, spec: Spec, plan: PlanView, groups: dict, coords: tuple):
        self.p, self.spec, self.plan = params, spec, plan
        self.tp_group = groups.get("tp", (None, None))[0]
        _, _, self.cp_index, self.tp_index = coords
        self.local_seq = spec.seq_len // plan.cp

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        spec, plan, t = self.spec, self.plan, self.plan.tp
        positions = torch.arange(self.cp_index * self.local_seq, (self.cp_index + 1) * self.local_seq)
        if plan.vocab_parallel and t > 1:
            rows = spec.vocab // t
            start = self.tp_index * rows
            outside = (tokens < start) | (tokens >= start + rows)
            x = F.embedding((tokens - start).clamp(0, rows - 1), self.p["tok_emb"]).masked_fill(outside[..., None], 0.0)
            x = par.ScatterReduce.apply(x, self.tp_group) if plan.sp else par.ReduceForward.apply(x, self.tp_group)
            if plan.sp:
                positions = positions.chunk(t)[self.tp_index]
        else:
            x = F.embedding(tokens, self.p["tok_emb"])
        if spec.positions == "learned":
            x = x + F.embedding(positions, self.p["pos_emb"])
        return x

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        spec, plan, t = self.spec, self.plan, self.plan.tp
        if spec.norm == "rmsnorm":
            y = par.RMSNorm.apply(x, self.p["lnf_w"])
        else:
            y = F.layer_norm(x, (x.shape[-1],), self.p["lnf_w"], self.p["lnf_b"])
        if plan.vocab_parallel and t > 1:
            if plan.sp:
                logits = par.GatherLinear.apply(y, self.p["head_w"], None, self.tp_group)
            else:
                logits = F.linear(par.ReduceBackward.apply(y, self.tp_group), self.p["head_w"])
            start = self.tp_index * (spec.vocab // t)
            return par.VocabParallelCrossEntropy.apply(logits, targets, start, self.tp_group)
        logits = F.linear(y, self.p["head_w"])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
