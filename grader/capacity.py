"""The kit's cost model of a parallel training plan (exercises 41-43, `ddp-grade plan`, the capacity quiz):
bytes each rank holds, bytes it sends, FLOPs it computes and the time of a step.

Pure Python, no torch. ``tests/test_capacity_measured.py`` holds every term against what real runs of the
same transformer measure (storages alive, bytes autograd saves, each collective's payload, FlopCounterMode),
so the model cannot drift from what PyTorch does. ``step_time`` here is 42's (every FLOP at the cluster's
one efficiency); the kit's own, from the same counts, is :mod:`grader.capacity_speed`. Searches, clusters
and scenarios are in :mod:`grader.capacity_plans`, the published runs the model is held to in
:mod:`grader.capacity_published`.

The transformer. Its defaults are GPT-style, the model of exercises 41-43: token and position embeddings;
L layers of LayerNorm, fused QKV Linear(h, 3h), attention (softmax, dropout on the probabilities), out
Linear(h, h), dropout, residual; LayerNorm, Linear(h, 4h), GELU, Linear(4h, h), dropout, residual; a final
LayerNorm and an untied head without bias. Frontier models (Llama 3, Mixtral, DeepSeek-V3) change:
``kv_heads`` (grouped-query attention), ``ffn`` and ``mlp="swiglu"`` (gate, up, SiLU(gate) x up, down),
``norm="rmsnorm"``, ``bias=False``, ``positions="rope"`` (no position embedding), ``dropout=False`` and
``experts`` (mixture-of-experts MLPs: ``top_k`` of ``experts`` routed, ``shared_experts`` always on, the
first ``dense_layers`` layers dense).

The plan. Rank order (Megatron's): tensor-parallel innermost, then context, then data, then pipeline:
    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index;
expert-parallel groups are ``ep`` consecutive data-parallel indices. Rank 0 (first pipeline rank, every
other index 0) is the rank every figure describes. Beyond 41-43: ``sp`` (sequence parallelism beside
tensor parallelism), ``cp`` (context parallelism: K and V all-gathered), ``vpp`` and ``stage_layers``
(interleaved virtual stages, stages of unequal depth), ZeRO 1-3 with pipeline stages, ``vocab_parallel``
(embeddings and head split over the tensor-parallel ranks), ``attention="flash"``, ``ep`` and
``capacity_factor`` (experts over ranks, slots per expert).

Sources: Rajbhandari et al. 2020 (ZeRO), Korthikanti et al. 2022 (activations, sequence parallelism),
Narayanan et al. 2021 (pipeline bubble, interleaving), Kaplan et al. 2020 (6 FLOPs per parameter per
token), Patarasuk and Yuan 2009 (ring all-reduce 2(n-1)/n), Llama 3 (section 3.3.2), GShard (capacity).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields

from grader.capacity_layout import (  # noqa: F401  (part of this module's interface)
    ATTENTIONS, PRECISIONS, RECOMPUTES, SCHEDULES, PlanError, chunk_layers, expert_ffn, ffn, in_flight, is_moe,
    kv_heads, layout, peak_in_flight, schedule, validate,
)

DIMENSIONS = ("dp", "tp", "pp", "cp", "ep", "edp")
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "send", "all-to-all")


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: int = 0              # 0: as many as heads
    ffn: int = 0                   # 0: 4 x hidden
    mlp: str = "gelu"              # or "swiglu"
    norm: str = "layernorm"        # or "rmsnorm"
    bias: bool = True              # biases in the layers' linear maps
    positions: str = "learned"     # or "rope": no position embedding
    dropout: bool = True           # dropout after attention's probabilities, out and the MLP
    experts: int = 0               # 0: dense MLPs
    top_k: int = 1
    expert_ffn: int = 0            # 0: ffn
    shared_experts: int = 0
    dense_layers: int = 0          # the first layers keep a dense MLP


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    precision: str = "bf16-mixed"
    recompute: str = "none"
    sp: bool = False               # sequence parallelism in the tensor-parallel group
    cp: int = 1                    # context-parallel ranks
    vpp: int = 1                   # virtual stages (model chunks) per pipeline rank
    stage_layers: tuple = ()       # layers of each virtual stage in order; () splits evenly
    vocab_parallel: bool = False   # embeddings and head split over the tensor-parallel ranks
    attention: str = "explicit"    # or "flash": neither scores nor probabilities kept
    ep: int = 1                    # expert-parallel ranks (inside the data-parallel group)
    capacity_factor: float = 1.0   # an expert's slots per rank: ceil(factor x tokens x top_k / experts)
    cp_comm: str = "all-gather"    # context parallelism's K and V: "all-gather" (Llama 3's) or "ring"
    scatter_gather: bool = False   # pipeline sends split over the tensor-parallel ranks, gathered after
    dp_overlap: bool = True        # data-parallel traffic overlaps compute (False: after the last backward)
    tp_overlap: bool = True        # backward's tensor-parallel collectives overlap the weight gradients' products
    grad_fp32: bool = False        # gradients accumulated and reduced over dp in float32 (Llama 3, section 3.3.2)
    tp_comm_overlap: bool = False  # every tensor-parallel collective in chunks under the layer's products (TE's
                                   # userbuffers, NeMo's ub_tp_comm_overlap)
    pp_overlap: bool = False       # pipeline sends and receives beside the compute (overlap_p2p_comm)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    peak_flops: float            # per GPU, dense bf16, FLOP/s (fp32 plans compute at half: TF32)
    mfu: float                   # the fraction of peak that compute achieves (one per GPU kind)
    memory_bytes: float          # per GPU
    intra_node_bandwidth: float  # bytes/s a GPU sends to a GPU of its node
    inter_node_bandwidth: float  # bytes/s a GPU sends to a GPU of another node
    intra_node_latency: float    # seconds per message inside a node
    inter_node_latency: float    # seconds per message across nodes


@dataclass
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    activations: float
    total: float


@dataclass
class Traffic:
    dp: dict = field(default_factory=dict)  # collective name -> bytes rank 0 sends per step
    tp: dict = field(default_factory=dict)
    pp: dict = field(default_factory=dict)
    cp: dict = field(default_factory=dict)
    ep: dict = field(default_factory=dict)
    edp: dict = field(default_factory=dict)  # the experts' data-parallel group

    def total(self) -> float:
        return sum(sum(getattr(self, d).values()) for d in DIMENSIONS)


@dataclass
class StepTime:
    flops: float
    compute_s: float
    dp_s: float
    tp_s: float
    pp_s: float
    bubble_s: float
    exposed_dp_s: float
    total_s: float
    cp_s: float = 0.0
    ep_s: float = 0.0


# The fields exercises 41-43 define (their dataclasses are the GPT-style part of these).
EXERCISE_FIELDS = {"ModelSpec": ("layers", "hidden", "heads", "vocab", "seq_len"),
                   "Plan": ("dp", "tp", "pp", "zero", "micro_batch", "micro_batches", "schedule", "precision",
                            "recompute"),
                   "StepTime": ("flops", "compute_s", "dp_s", "tp_s", "pp_s", "bubble_s", "exposed_dp_s", "total_s")}


def exercise_plan(model: ModelSpec, plan: Plan) -> bool:
    """True when model and plan use no field beyond 41-43's (the GPT-style model and plans)."""
    return all(getattr(model, f.name) == f.default for f in fields(ModelSpec) if f.name not in
               EXERCISE_FIELDS["ModelSpec"]) and \
        all(getattr(plan, f.name) == f.default for f in fields(Plan) if f.name not in EXERCISE_FIELDS["Plan"])


# --- counts -----------------------------------------------------------------------------------------------


def _linear(rows: int, cols: int, tp: int, bias: bool, split_bias: bool) -> int:
    """A Linear's weight (split over tp) and its bias (split with the weight, or whole)."""
    return rows * cols // tp + ((cols // tp if split_bias else cols) if bias else 0)


def mlp_params(model: ModelSpec, tp: int, width: int) -> int:
    """One MLP of ``width`` on one tensor rank: gelu fc1 and fc2, or swiglu's gate, up and down."""
    h, b = model.hidden, model.bias
    first = 2 if model.mlp == "swiglu" else 1
    return first * _linear(h, width, tp, b, True) + _linear(width, h, tp, b, False)


def norm_params(model: ModelSpec) -> int:
    return 2 * model.hidden if model.norm == "layernorm" else model.hidden


def layer_parts(model: ModelSpec, tp: int, ep: int = 1, layer: int = 0) -> tuple[int, int]:
    """(dense, expert) parameters of one layer on one tensor rank. Split as Megatron-LM splits them: QKV
    and the first MLP matrices by output features (weight and bias), out and the last by input features
    (their biases whole), norms and a router whole; experts spread over ep ranks."""
    h, d = model.hidden, model.hidden // model.heads
    qkv = h + 2 * kv_heads(model) * d
    dense = _linear(h, qkv, tp, model.bias, True) + _linear(h, h, tp, model.bias, False) + 2 * norm_params(model)
    if not is_moe(model, layer):
        return dense + mlp_params(model, tp, ffn(model)), 0
    dense += h * model.experts + model.shared_experts * mlp_params(model, tp, expert_ffn(model))
    return dense, model.experts // ep * mlp_params(model, tp, expert_ffn(model))


def layer_params(model: ModelSpec, tp: int) -> int:
    """Parameters of one (dense) transformer layer on one tensor-parallel rank."""
    return sum(layer_parts(model, tp))


@functools.lru_cache(maxsize=65536)
def rank_parts(model: ModelSpec, plan: Plan, rank: int = 0) -> tuple[tuple[int, int], ...]:
    """(dense, expert) parameters of each of ``rank``'s chunks: its layers, the embeddings on the first
    virtual stage, the final norm and the head on the last (split over tp when vocab_parallel)."""
    h, V = model.hidden, model.vocab
    vocab = V // plan.tp if plan.vocab_parallel else V
    out = []
    for c, layers in enumerate(chunk_layers(model, plan, rank)):
        parts = [layer_parts(model, plan.tp, plan.ep, i) for i in layers]
        dense, expert = sum(p[0] for p in parts), sum(p[1] for p in parts)
        if rank == 0 and c == 0:
            dense += vocab * h + (model.seq_len * h if model.positions == "learned" else 0)
        if rank == plan.pp - 1 and c == plan.vpp - 1:
            dense += norm_params(model) + h * vocab
        out.append((dense, expert))
    return tuple(out)


def stage_params(model: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds before any ZeRO sharding."""
    return sum(d + e for d, e in rank_parts(model, plan, stage))


def total_params(model: ModelSpec) -> int:
    return stage_params(model, Plan())


def active_params(model: ModelSpec) -> int:
    """Parameters one token's forward uses: every dense one, top_k of the routed experts."""
    if not model.experts:
        return total_params(model)
    routed = (model.layers - model.dense_layers) * (model.experts - model.top_k) * mlp_params(model, 1, expert_ffn(model))
    return total_params(model) - routed


def shard(count: int, ranks: int) -> int:
    """Elements each rank keeps of a flat buffer of ``count`` padded to a multiple of ``ranks``."""
    return -(-count // ranks)


def element_bytes(plan: Plan) -> int:
    """Bytes of one element of the parameters that compute, their gradients and the activations (fp8-mixed
    keeps them in bf16: only the linear maps' products cast to float8)."""
    return 4 if plan.precision == "fp32" else 2


def grad_bytes(plan: Plan) -> int:
    """Bytes of one gradient element as kept and reduced: the element's, or float32 with grad_fp32."""
    return 4 if plan.grad_fp32 else element_bytes(plan)


def optimizer_bytes_per_param(plan: Plan) -> int:
    """Adam's momentum and variance in float32, plus the float32 master weights under bf16-mixed."""
    return 8 if plan.precision == "fp32" else 12


def buffers(model: ModelSpec, plan: Plan, rank: int = 0) -> list[tuple[int, int]]:
    """(elements, ranks sharing it) of each flat buffer ZeRO shards: one per chunk for the dense
    parameters (over dp x cp), one per chunk for the experts' (over dp / ep)."""
    out = []
    for dense, expert in rank_parts(model, plan, rank):
        out.append((dense, plan.dp * plan.cp))
        if expert:
            out.append((expert, plan.dp // plan.ep))
    return out


# --- exercise 41: memory ----------------------------------------------------------------------------------


def tokens(model: ModelSpec, plan: Plan) -> int:
    """Tokens of one micro-batch on one context-parallel rank."""
    return model.seq_len // plan.cp * plan.micro_batch


def expert_capacity(model: ModelSpec, plan: Plan) -> int:
    """Slots each expert keeps for one rank's micro-batch (GShard's capacity)."""
    return math.ceil(plan.capacity_factor * tokens(model, plan) * model.top_k / model.experts)


def layer_activations(model: ModelSpec, plan: Plan, layer: int = 0) -> int:
    """Bytes one layer keeps for backward for one micro-batch on one rank (Korthikanti et al. 2022's
    count for any element size e: masks 1 byte; RMSNorm's and flash attention's statistics in fp32).
    Outside the tensor-parallel region (norms' inputs, QKV's and the MLP's inputs, two dropout masks):
    whole, or split over tp under sequence parallelism; inside it, split over tp."""
    s, h, a, t = model.seq_len, model.hidden, model.heads, plan.tp
    n, e = tokens(model, plan), element_bytes(plan)
    split = t if plan.sp else 1
    if plan.recompute == "full":
        return e * n * h // split  # the layer's input only
    outside = (4 * e + (2 if model.dropout else 0)) * n * h // split
    if model.norm == "rmsnorm":
        outside += 2 * 4 * n // split  # each norm's 1/rms, fp32
    d, kv = h // a, kv_heads(model)
    if plan.attention == "flash":  # Q, K and V as one tensor, the output, log-sum-exp
        inside = e * n * (2 * h + 2 * kv * d) // t + 4 * n * a // t
    else:
        inside = 4 * e * n * h // t  # Q, K, V (K and V repeated to every head), out's input
        if plan.recompute == "none":
            inside += (2 * e + 1 if model.dropout else e) * a * n * s // t  # softmax out, mask, dropout out
    if not is_moe(model, layer):
        width = 4 if model.mlp == "swiglu" else 2  # swiglu: gate, SiLU(gate), up, their product
        return outside + inside + width * e * n * ffn(model) // t
    return outside + inside + moe_activations(model, plan)


def moe_activations(model: ModelSpec, plan: Plan) -> int:
    """A mixture-of-experts MLP's (tp 1): the router's probabilities (fp32) and top-k indices, each slot's
    token index, the local experts' inputs and activations (every slot, filled or not), each choice's slot
    index, the rows the choices pick from the experts' outputs and their gates; then the shared experts."""
    n, e, h = tokens(model, plan), element_bytes(plan), model.hidden
    k, E, f = model.top_k, model.experts, expert_ffn(model)
    width = 4 if model.mlp == "swiglu" else 2
    slots = E * expert_capacity(model, plan)  # rows this rank sends (and receives, and computes)
    router = 4 * n * E + 8 * n * k
    experts = 8 * slots + e * slots * h + width * e * slots * f
    combine = 8 * n * k + e * n * k * h + e * n * k
    shared = model.shared_experts * width * e * n * f
    return router + experts + combine + shared


def chunk_activations(model: ModelSpec, plan: Plan, rank: int = 0) -> list[int]:
    return [sum(layer_activations(model, plan, i) for i in layers) for layers in chunk_layers(model, plan, rank)]


def training_memory(model: ModelSpec, plan: Plan) -> MemoryBreakdown:
    validate(model, plan)
    e, k = element_bytes(plan), optimizer_bytes_per_param(plan)
    whole = sum(count for count, _ in buffers(model, plan))
    part = sum(shard(count, ranks) for count, ranks in buffers(model, plan))
    params = e * (part if plan.zero >= 3 else whole)
    grads = grad_bytes(plan) * (part if plan.zero >= 2 else whole)
    optimizer = k * (part if plan.zero >= 1 else whole)
    activations = peak_in_flight(plan, chunk_activations(model, plan, 0))
    return MemoryBreakdown(params, grads, optimizer, activations, params + grads + optimizer + activations)


# --- exercise 42: traffic and time ------------------------------------------------------------------------


def ring_factor(collective: str, n: int) -> float:
    """Bytes a rank sends in a ring collective over ``n`` ranks, per byte of the whole buffer."""
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": (n - 1) / n, "all-gather": (n - 1) / n,
            "send": 1.0, "all-to-all": (n - 1) / n}[collective]


def group_size(plan: Plan, dimension: str) -> int:
    return {"dp": plan.dp * plan.cp, "tp": plan.tp, "pp": plan.pp, "cp": plan.cp, "ep": plan.ep,
            "edp": plan.dp // plan.ep}[dimension]


def layer_collectives(model: ModelSpec, plan: Plan, layer: int = 0) -> list[tuple[str, str, int, int]]:
    """The collectives one layer costs one micro-batch on rank 0: (dimension, collective, calls, bytes)."""
    t, e, h = plan.tp, element_bytes(plan), model.hidden
    activation = e * tokens(model, plan) * h
    full = plan.recompute == "full"
    out = []
    if t > 1 and not plan.sp:  # 2 forward (+2 recomputed), 2 backward
        out.append(("tp", "all-reduce", 6 if full else 4, activation))
    elif t > 1:  # per block: gather, scatter forward; gather the input again and the gradient, scatter backward
        out += [("tp", "all-gather", 8 if full else 6, activation), ("tp", "reduce-scatter", 6 if full else 4, activation)]
    kv = e * model.seq_len * plan.micro_batch * 2 * kv_heads(model) * (h // model.heads) // t  # every rank's
    if plan.cp > 1 and plan.cp_comm == "ring":  # a block to the next rank cp - 1 times; backward again, and the
        c = plan.cp                               # gradients on to the block's owner (cp sends)
        out.append(("cp", "send", (c - 1) * (3 if full else 2) + c, kv // c))
    elif plan.cp > 1:  # K and V gathered forward, gathered again and their gradients reduce-scattered backward
        out += [("cp", "all-gather", 3 if full else 2, kv), ("cp", "reduce-scatter", 1, kv)]
    if plan.ep > 1 and is_moe(model, layer):  # dispatch and combine forward (+recomputed), and both backward
        out.append(("ep", "all-to-all", 6 if full else 4, e * model.experts * expert_capacity(model, plan) * h))
    return out


def collective_list(model: ModelSpec, plan: Plan) -> list[tuple[str, str, int, int]]:
    """Every collective rank 0 takes part in per step: (dimension, collective, calls, bytes of the whole
    buffer each call). A reduce-scatter's and an all-gather's buffer over dp is the padded flat buffer;
    ZeRO keeps one flat buffer per chunk (dense parameters over dp x cp, experts over dp / ep)."""
    validate(model, plan)
    m, t, e, h = plan.micro_batches, plan.tp, element_bytes(plan), model.hidden
    out: list = []
    g = grad_bytes(plan)
    for count, ranks in buffers(model, plan):
        dimension = "dp" if ranks == plan.dp * plan.cp else "edp"
        padded = ranks * shard(count, ranks)
        if ranks > 1 and plan.zero == 0:
            out.append((dimension, "all-reduce", 1, g * count))
        elif ranks > 1 and plan.zero in (1, 2):
            out.append((dimension, "reduce-scatter", m if plan.zero == 2 else 1, g * padded))
            out.append((dimension, "all-gather", 1, e * padded))
        elif ranks > 1:
            out.append((dimension, "all-gather", 2 * m, e * padded))  # before each forward and each backward
            out.append((dimension, "reduce-scatter", m, g * padded))
    layers = [i for c in chunk_layers(model, plan) for i in c]
    for i in layers:
        out += [(d, name, m * calls, size) for d, name, calls, size in layer_collectives(model, plan, i)]
    activation = e * tokens(model, plan) * h
    if t > 1 and plan.sp:  # gradients of what each rank computed on its own tokens: norms, row-parallel biases
        chunks = chunk_layers(model, plan)
        for c, layers in enumerate(chunks):
            kept = len(layers) * (2 * norm_params(model) + (2 * h if model.bias else 0))
            kept += model.seq_len * h if c == 0 and model.positions == "learned" else 0
            kept += norm_params(model) if plan.pp == 1 and c == len(chunks) - 1 else 0
            out.append(("tp", "all-reduce", m if plan.zero >= 2 else 1, e * kept))
    if t > 1 and plan.vocab_parallel:  # the embedding's partial sums; the head's on the last stage
        out.append(("tp", "reduce-scatter" if plan.sp else "all-reduce", m, activation))
        if plan.sp:
            out.append(("tp", "all-gather", m, activation))
        if plan.pp == 1:
            out += _head_collectives(model, plan, activation)
    if plan.pp > 1:  # each chunk's output forward; each chunk's input gradient but the first's backward
        split = t if plan.sp or plan.scatter_gather else 1
        out.append(("pp", "send", m * (2 * plan.vpp - 1), activation // split))
        if plan.scatter_gather and t > 1 and not plan.sp:  # what rank 0 receives, gathered in its node
            out.append(("tp", "all-gather", m * (2 * plan.vpp - 1), activation))
    return merged(out)


def merged(entries: list) -> list:
    """Entries of one dimension, collective and buffer size added up, in first-seen order."""
    out: dict = {}
    for dimension, name, calls, size in entries:
        if calls:
            key = (dimension, name, size)
            out[key] = out.get(key, 0) + calls
    return [(d, name, calls, size) for (d, name, size), calls in out.items()]


def _head_collectives(model: ModelSpec, plan: Plan, activation: int) -> list:
    """A vocabulary-parallel head: its input gathered (sp) or its gradient all-reduced; the cross entropy's
    max, sum of exponentials and target logit all-reduced in fp32."""
    m, n = plan.micro_batches, tokens(model, plan)
    out = [("tp", "all-gather", 2 * m, activation), ("tp", "reduce-scatter", m, activation)] if plan.sp else \
        [("tp", "all-reduce", m, activation)]
    return out + [("tp", "all-reduce", 3 * m, 4 * n)]


def collectives(model: ModelSpec, plan: Plan) -> dict:
    """collective_list as {(dimension, collective): (calls, bytes of the whole buffer each call)}, for
    plans whose calls of one kind all carry the same buffer (41-43's); PlanError otherwise."""
    out: dict = {}
    for dimension, name, calls, size in collective_list(model, plan):
        key = (dimension, name)
        if key in out and out[key][1] != size:
            raise PlanError(f"{dimension} {name} carries buffers of several sizes: use collective_list")
        out[key] = (out.get(key, (0, size))[0] + calls, size)
    return out


def communication(model: ModelSpec, plan: Plan) -> Traffic:
    traffic = Traffic()
    for dimension, name, calls, size in collective_list(model, plan):
        sent = calls * size * ring_factor(name, group_size(plan, dimension))
        kept = getattr(traffic, dimension)
        kept[name] = kept.get(name, 0.0) + sent
    return traffic


def layer_flops(model: ModelSpec, plan: Plan, layer: int = 0) -> int:
    """Matmul FLOPs of one layer's forward for one micro-batch on one rank: 2 per weight per token
    (experts: per slot), and QK^T and times V over the whole sequence (4 b s_q s h; not halved for a
    causal mask, as FlopCounterMode counts them)."""
    h, t, n = model.hidden, plan.tp, tokens(model, plan)
    d = h // model.heads
    weights = h * (h + 2 * kv_heads(model) * d) + h * h
    width = 3 if model.mlp == "swiglu" else 2
    out = 2 * n * weights // t + 4 * n * model.seq_len * h // t
    if not is_moe(model, layer):
        return out + 2 * n * width * h * ffn(model) // t
    slots = model.experts * expert_capacity(model, plan)
    routed = 2 * slots * width * h * expert_ffn(model) // t
    return out + 2 * n * h * model.experts + routed + 2 * n * model.shared_experts * width * h * expert_ffn(model) // t


def attention_core_flops(model: ModelSpec, plan: Plan) -> int:
    return 4 * tokens(model, plan) * model.seq_len * model.hidden // plan.tp


def head_flops(model: ModelSpec, plan: Plan) -> int:
    """The head's forward for one micro-batch on one rank (whole, or split over tp when vocab_parallel)."""
    vocab = model.vocab // plan.tp if plan.vocab_parallel else model.vocab
    return 2 * tokens(model, plan) * model.hidden * vocab


def layer_step_flops(model: ModelSpec, plan: Plan, layer: int = 0) -> int:
    """One layer's FLOPs for one micro-batch: forward, backward twice the forward, what is recomputed;
    flash attention's backward recomputes QK^T (2.5 times its forward, as torch counts it)."""
    forward = layer_flops(model, plan, layer)
    total = 3 * forward
    if plan.attention == "flash":
        total += attention_core_flops(model, plan) // 2
    if plan.recompute == "full":
        total += forward
    elif plan.recompute == "selective":
        total += attention_core_flops(model, plan)
    return total


def flops(model: ModelSpec, plan: Plan) -> int:
    """FLOPs rank 0 computes per step, the head's on the last stage (rank 0's when pp == 1); embeddings
    are lookups."""
    validate(model, plan)
    per_micro = sum(layer_step_flops(model, plan, i) for c in chunk_layers(model, plan) for i in c)
    if plan.pp == 1:
        per_micro += 3 * head_flops(model, plan)
    return plan.micro_batches * per_micro


def group_span(plan: Plan, dimension: str) -> int:
    """How many consecutive ranks one group of ``dimension`` spans (tp innermost, pp outermost)."""
    t, c, d = plan.tp, plan.cp, plan.dp
    return {"tp": t, "cp": t * c, "ep": t * c * plan.ep, "dp": t * c * d, "edp": t * c * d,
            "pp": t * c * d * plan.pp}[dimension]


def link(cluster: Cluster, plan: Plan, dimension: str) -> tuple[float, float]:
    """(bandwidth, latency) of ``dimension``'s groups: inside a node when the group spans at most one."""
    if group_span(plan, dimension) <= cluster.gpus_per_node:
        return cluster.intra_node_bandwidth, cluster.intra_node_latency
    return cluster.inter_node_bandwidth, cluster.inter_node_latency


def latency_steps(collective: str, n: int) -> int:
    """Messages in sequence in a ring collective: 2(n-1) for an all-reduce, n-1 for the others."""
    return {"all-reduce": 2 * (n - 1), "send": 1}.get(collective, n - 1)


def collective_seconds(plan: Plan, cluster: Cluster, dimension: str, name: str, calls: int, size: float) -> float:
    """Bytes over the link's bandwidth plus a latency per message in sequence, for each call."""
    n = group_size(plan, dimension)
    bandwidth, latency = link(cluster, plan, dimension)
    return calls * (size * ring_factor(name, n) / bandwidth + latency_steps(name, n) * latency)


def layer_seconds(model: ModelSpec, plan: Plan, cluster: Cluster, layer: int, rate: float) -> float:
    """One layer's compute and critical traffic for one micro-batch."""
    return layer_step_flops(model, plan, layer) / rate + sum(
        collective_seconds(plan, cluster, *entry) for entry in layer_collectives(model, plan, layer))


def step_time(model: ModelSpec, plan: Plan, cluster: Cluster) -> StepTime:
    """Rank 0's step. busy: its compute and the communication on its critical path (tp, pp, cp, ep).
    The pipeline runs at the pace of its busiest rank (rank 0's per micro-batch, plus what the busiest
    rank's layers take beyond rank 0's: compute and traffic; the head's work is not counted in the pace)
    and fills and drains in (pp - 1) / vpp of that pace: bubble_s = pipeline time - busy. Data-parallel
    traffic overlaps compute (dp_overlap), or adds to the step."""
    validate(model, plan, cluster.gpus)
    if plan.precision == "fp8-mixed":
        raise PlanError("fp8-mixed is timed by the kit's model (grader.capacity_speed), not at one efficiency")
    work = flops(model, plan)
    rate = cluster.peak_flops * cluster.mfu * (1.0 if plan.precision == "bf16-mixed" else 0.5)
    compute_s = work / rate
    seconds = dict.fromkeys(DIMENSIONS, 0.0)
    for entry in collective_list(model, plan):
        seconds[entry[0]] += collective_seconds(plan, cluster, *entry)
    critical = seconds["tp"] + seconds["pp"] + seconds["cp"] + seconds["ep"]
    busy = compute_s + critical
    m = plan.micro_batches
    kinds = {moe: layer_seconds(model, plan, cluster, i, rate)  # a dense layer's, an MoE layer's
             for moe, i in {is_moe(model, i): i for i in range(model.layers)}.items()}
    paces = [sum(kinds[is_moe(model, i)] for c in chunk_layers(model, plan, r) for i in c) for r in range(plan.pp)]
    extra = max(0.0, max(paces) - paces[0])  # per micro-batch: the busiest rank's layers set the pace
    bubble_s = (busy + m * extra) * (plan.pp - 1) / (m * plan.vpp) + m * extra
    data = seconds["dp"] + seconds["edp"]
    exposed = max(0.0, data - compute_s) if plan.dp_overlap else data
    return StepTime(float(work), compute_s, seconds["dp"] + seconds["edp"], seconds["tp"], seconds["pp"], bubble_s,
                    exposed, busy + bubble_s + exposed, seconds["cp"], seconds["ep"])


def to_dict(value) -> dict:
    """A dataclass of this module as plain data."""
    return {f.name: getattr(value, f.name) for f in fields(value)}


def exercise_dict(value) -> dict:
    """A ModelSpec, Plan or StepTime with 41-43's fields only (their dataclasses are built from it)."""
    return {name: getattr(value, name) for name in EXERCISE_FIELDS[type(value).__name__]}

