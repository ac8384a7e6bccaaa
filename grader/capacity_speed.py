"""The kit's step time (``ddp-grade plan``, the kit's planner, the published runs): what 42's napkin leaves out.

42's step time (:func:`grader.capacity.step_time`) runs every FLOP at one efficiency per GPU kind, hides
data-parallel traffic behind the whole step and has every rank finish together. This one keeps its counts
(FLOPs, every collective, the pipeline's pace and bubble) and times them as a GPU runs them:

* **A matmul's efficiency from its shape.** A GPU computes a product in tiles of 256 x 128 outputs, one
  tile per streaming multiprocessor (SM) at a time, in waves over its SMs (NVIDIA, "Matrix Multiplication
  Background User's Guide", 2023: tile and wave quantization). Part-empty tiles and part-empty last waves
  are paid in full. Each tile also has a fixed cost (loading its first slices, writing its outputs) worth
  K0 multiply-adds of its inner dimension k: a tile multiplies k / (k + K0) of its time. A product never
  beats its operands' bytes over the memory's bandwidth (the roofline), and large products reach the
  largest fraction of peak measured on the GPU ("maximum achievable matmul FLOPS", MAMF), at the clock it
  sustains under a training load (SUSTAINED of the burst), no more.
* **Attention.** Explicit attention is two batched products per head (QK^T, inner dimension the head's d;
  times V, inner dimension the sequence) and their four gradients, costed as above, and its scores' softmax and dropout are work
  bound by memory (below). Flash attention is one fused kernel at the fraction of peak FlashAttention-2
  measured on the GPU kind, over half the scores (a causal mask: the blocks above the diagonal are
  skipped).
* **Work bound by memory.** Norms, activation functions, dropout and residual adds, rotary embeddings, the
  loss over the vocabulary and the optimizer's update read and write their tensors once each, fused as
  Megatron-LM fuses them: bytes over the memory's bandwidth.
* **float8** (``precision="fp8-mixed"``): the layers' linear maps multiply in float8 at the float8 peak
  and ceiling (35's recipe: the input and the weight forward, the output's gradient backward, each scaled
  and cast), each cast reading its bf16 operand and writing the byte in both layouts the products need;
  attention, the head and everything else stay bf16.
* **The cost of scale.** Collectives move data at LINK_EFFICIENCY of the bandwidth their rings run at,
  plus a latency per message in sequence, which grows with the ranks (42's ring). Across nodes every GPU
  has a network card of its own, so a ring whose group has g members in each node runs as g rings at once,
  one through each card (NCCL's channels): g cards' bandwidth, at most NVLink's (``ring_bandwidth``).
  Backward's tensor-parallel collectives that need not wait (the input's gradient reduced, with sequence
  parallelism the input gathered again) run under the weight gradients' products (``tp_overlap``); with
  ``tp_comm_overlap`` every tensor-parallel collective runs under the layer's products (Transformer
  Engine's userbuffers), with ``pp_overlap`` the pipeline's sends beside the compute. Data-parallel traffic
  hides only behind the compute it can overlap in the schedule (a gradient reduction behind the backwards
  after its chunk's last one, a parameter gather behind the forwards before its chunk's first), the rest
  adds to the step. The pipeline runs at the pace of its busiest rank, the last one's head and loss
  included. And every step waits for the slowest of its ranks: with the ranks' speeds spread by JITTER (a
  fraction), the slowest of N is on average ``slowest_of(N)`` spreads behind (the expected maximum of N
  normal variables: 1.42 at 8, 3.96 at 16,384).

Measured or published: ``DEVICES`` (data sheets, MAMF, FlashAttention-2), SUSTAINED and JITTER (MAMF
finder runs on 8-GPU nodes). Fitted: K0 and LINK_EFFICIENCY, once, to the rows of
:data:`grader.capacity_published.FIT_ROWS` (``capacity_published.fit``); the held-out rows check them.
Pure Python.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

from grader import capacity
from grader.capacity import Cluster, ModelSpec, Plan, PlanError, StepTime


@dataclass(frozen=True)
class Device:
    """What a GPU kind computes with, each from its data sheet or a published measurement."""
    sms: int                       # streaming multiprocessors
    flops: float                   # dense bf16 peak
    matmul_ceiling: float          # the largest fraction of the dense bf16 peak a matmul reaches (MAMF / peak)
    memory_bytes_per_s: float      # HBM bandwidth
    flash_utilization: float       # the fraction of the bf16 peak flash attention runs at (FlashAttention-2)
    fp8_flops: float = 0.0         # dense float8 peak (0: no float8 tensor cores)
    fp8_matmul_ceiling: float = 0.0


# SMs, bandwidth and peaks: NVIDIA's A100 80GB SXM (108 SMs, 2,039 GB/s) and H100 SXM5 (132 SMs, 3.35 TB/s,
# 1,979 dense float8 TFLOP/s) data sheets. Ceilings: the MAMF table of S. Bekman, "Machine Learning
# Engineering" (github.com/stas00/ml-engineering, compute/accelerator/README.md, August 2026): bf16 A100 SXM
# 271.2 of 312 TFLOP/s, H100 SXM 794.5 of 989; float8 H100 SXM 1,402.6 of 1,979. Flash attention: Dao,
# "FlashAttention-2" (2023): 50-73 % of the A100's peak (0.6 here); Shah et al., "FlashAttention-3" (2024):
# FlashAttention-2 reaches 35 % of the H100's (FlashAttention-3 up to 75 %: runs on it are faster than this).
DEVICES = {
    "A100": Device(sms=108, flops=312e12, matmul_ceiling=271.2 / 312, memory_bytes_per_s=2.039e12, flash_utilization=0.6),
    "H100": Device(sms=132, flops=989e12, matmul_ceiling=794.5 / 989, memory_bytes_per_s=3.35e12, flash_utilization=0.35,
                   fp8_flops=1979e12, fp8_matmul_ceiling=1402.6 / 1979),
}
TILE = (256, 128)  # a tile's outputs: cuBLAS's largest for bf16 on the A100 and H100 (the NVIDIA guide above)

# Measured: MAMF finder runs (ml-engineering, compute/accelerator/benchmarks/README.md). SUSTAINED: a bf16
# matmul held at the power limit against a boost burst, 702.9 / 828.0 TFLOP/s on an H200 (the H100's chip)
# and 1,455.7 / 1,732.6 on a B200, 0.85 both. JITTER: on 8 H200s computing together the slowest reached
# 727 TFLOP/s and the median 752; the slowest of 8 normal variables is 1.42 spreads out: 3.3 % / 1.42.
SUSTAINED = 0.85
JITTER = 0.023
# Fitted to FIT_ROWS (capacity_published.fit): see the module's docstring.
K0 = 201.0
LINK_EFFICIENCY = 0.87


@dataclass(frozen=True)
class Constants:
    k0: float = K0
    link_efficiency: float = LINK_EFFICIENCY
    sustained: float = SUSTAINED
    jitter: float = JITTER


FITTED = Constants()
FLASH_PASSES = 3.5  # flash attention's products: forward, backward twice, QK^T again (torch's count: 2.5 x forward)


def device_of(kind: str | None) -> Device:
    if kind not in DEVICES:
        raise PlanError("the kit's step time knows the H100 and the A100; for another GPU give "
                        "--compute-efficiency (42's step time at one efficiency)")
    return DEVICES[kind]


# --- one matmul -------------------------------------------------------------------------------------------


def matmul_seconds(m: int, n: int, k: int, device: Device, rate: float, k0: float, element: float = 2.0,
                   batch: int = 1) -> float:
    """``batch`` products of (m x k) by (k x n) at ``rate`` (the peak times the ceiling it can reach): tiles of
    TILE outputs in waves over the SMs, each multiplying k / (k + k0) of its time; never faster than its
    operands (``element`` bytes each) and its bf16 output over the memory's bandwidth."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    big, small = max(m, n), min(m, n)
    tiles = math.ceil(big / TILE[0]) * math.ceil(small / TILE[1]) * batch
    waves = math.ceil(tiles / device.sms)
    filled = big * small * batch / (waves * device.sms * TILE[0] * TILE[1])
    compute = 2.0 * m * n * k * batch * (k + k0) / (rate * filled * k)
    memory = (element * (m * k + k * n) + 2.0 * m * n) * batch / device.memory_bytes_per_s
    return max(compute, memory)


def matmul_efficiency(m: int, n: int, k: int, kind: str, constants: Constants = None) -> float:
    """The fraction of the dense bf16 peak a (m x k) by (k x n) product reaches on ``kind``."""
    constants = constants or FITTED
    device = device_of(kind)
    rate = device.flops * device.matmul_ceiling * constants.sustained
    return 2.0 * m * n * k / matmul_seconds(m, n, k, device, rate, constants.k0) / device.flops


# --- one layer --------------------------------------------------------------------------------------------


def linear_shapes(model: ModelSpec, plan: Plan, layer: int = 0) -> list[tuple[int, int, int, int]]:
    """(m, n, k, count) of each linear map's forward product on rank 0 for one micro-batch: QKV, out, the
    MLP's first (gate and up together for SwiGLU) and last; for an MoE layer the router, each local expert's
    two at its slots, and the shared experts'."""
    h, t = model.hidden, plan.tp
    tokens = capacity.tokens(model, plan)
    qkv = h + 2 * capacity.kv_heads(model) * (h // model.heads)
    first = 2 if model.mlp == "swiglu" else 1
    out = [(tokens, qkv // t, h, 1), (tokens, h, h // t, 1)]
    if not capacity.is_moe(model, layer):
        f = capacity.ffn(model)
        return out + [(tokens, first * f // t, h, 1), (tokens, h, f // t, 1)]
    f = capacity.expert_ffn(model)
    slots = capacity.expert_capacity(model, plan) * plan.ep  # rows each local expert computes
    out += [(tokens, model.experts, h, 1), (slots, first * f // t, h, model.experts // plan.ep),
            (slots, h, f // t, model.experts // plan.ep)]
    if model.shared_experts:
        out += [(tokens, first * f // t, h, model.shared_experts), (tokens, h, f // t, model.shared_experts)]
    return out


@dataclass
class LayerCost:
    matmul_s: float = 0.0          # the linear maps: forward, both backward products, what is recomputed
    weight_grad_s: float = 0.0     # of which the weight gradients' products
    attention_s: float = 0.0       # QK^T and times V (explicit), or the flash kernel
    memory_s: float = 0.0          # work bound by memory, float8's casts included

    def total(self) -> float:
        return self.matmul_s + self.attention_s + self.memory_s


def layer_cost(model: ModelSpec, plan: Plan, device: Device, peak: float, constants: Constants,
               layer: int = 0) -> LayerCost:
    """One layer's compute for one micro-batch on rank 0: forward, backward and what is recomputed."""
    k0, e = constants.k0, capacity.element_bytes(plan)
    cost = LayerCost()
    if plan.precision == "fp8-mixed":
        rate, element = device.fp8_flops * device.fp8_matmul_ceiling * constants.sustained, 1.0
    else:
        rate, element = peak * device.matmul_ceiling * constants.sustained, e
    shapes = linear_shapes(model, plan, layer)
    for m, n, k, count in shapes:
        forward = count * matmul_seconds(m, n, k, device, rate, k0, element)
        weight = count * matmul_seconds(k, n, m, device, rate, k0, element)
        cost.matmul_s += forward * (2 if plan.recompute == "full" else 1) + weight \
            + count * matmul_seconds(m, k, n, device, rate, k0, element)
        cost.weight_grad_s += weight
    s, d, heads = model.seq_len, model.hidden // model.heads, model.heads // plan.tp
    queries, batch = s // plan.cp, plan.micro_batch * heads
    if plan.attention == "flash":
        passes = FLASH_PASSES + (1 if plan.recompute == "full" else 0)
        cost.attention_s = passes * 4.0 * d * queries * s * batch / 2 / (peak * device.flash_utilization)
    else:  # scores (queries x s, inner d), times V (queries x d, inner s); backward, their four gradients:
        # the probabilities' (inner d) and V's, Q's and K's (inner s); recomputation runs forward again
        ceiling = peak * device.matmul_ceiling * constants.sustained
        scores = matmul_seconds(queries, s, d, device, ceiling, k0, e, batch)
        values = matmul_seconds(queries, d, s, device, ceiling, k0, e, batch)
        again = 1 if plan.recompute in ("full", "selective") else 0
        cost.attention_s = (2 + again) * scores + (4 + again) * values
    cost.memory_s = memory_bytes(model, plan, layer) / device.memory_bytes_per_s
    if plan.precision == "fp8-mixed":
        cost.memory_s += cast_bytes(shapes) / device.memory_bytes_per_s
    return cost


def memory_bytes(model: ModelSpec, plan: Plan, layer: int = 0) -> float:
    """Bytes one layer's memory-bound work reads and writes for one micro-batch on rank 0, fused as
    Megatron-LM fuses it. Per token and element: forward, a norm reads its input and writes its output;
    bias, dropout and the residual add are one pass (read two, write one, a one-byte mask); backward reads
    the gradient and what was kept and writes the input's gradient, for each. The MLP's activation: GELU
    reads and writes its input (backward: reads the gradient and the input, writes one); SwiGLU reads gate
    and up and writes their product (backward: reads three, writes two). Explicit attention's scores:
    scale, mask and softmax in one pass, dropout; their gradients backward. Rotary embeddings rotate q and k
    and their gradients. Full recomputation runs forward's passes again, selective the scores'."""
    h, t, s = model.hidden, plan.tp, model.seq_len
    tokens = capacity.tokens(model, plan)
    e = capacity.element_bytes(plan)
    mask = 1 if model.dropout else 0
    outside = tokens * h / (t if plan.sp else 1)  # the elements outside the tensor-parallel region
    forward = outside * (2 * 2 * e + 2 * (3 * e + mask))
    backward = outside * (2 * 3 * e + 2 * (3 * e + mask))
    if capacity.is_moe(model, layer):
        inside = (capacity.expert_capacity(model, plan) * model.experts + tokens * model.shared_experts) \
            * capacity.expert_ffn(model)
    else:
        inside = tokens * capacity.ffn(model) / t
    act_forward, act_backward = (3 * e, 5 * e) if model.mlp == "swiglu" else (2 * e, 3 * e)
    forward += inside * act_forward
    backward += inside * act_backward
    if model.positions == "rope":
        rotated = 2 * e * tokens * (h + capacity.kv_heads(model) * (h // model.heads)) / t
        forward, backward = forward + rotated, backward + rotated
    total = forward + backward + (forward if plan.recompute == "full" else 0.0)
    if plan.attention == "explicit":
        scores = tokens * s * model.heads / t
        dropout = 2 * e + mask if model.dropout else 0
        total += scores * ((2 * e + dropout) * (2 if plan.recompute != "none" else 1) + 3 * e + dropout)
    return total


def cast_bytes(shapes) -> float:
    """float8's casts for one micro-batch: each operand of each product (input and weight forward, the
    output's gradient backward) read in bf16 and written as one byte in the two layouts its products need."""
    return sum(count * 4.0 * (m * k + k * n + m * n) for m, n, k, count in shapes)


def head_seconds(model: ModelSpec, plan: Plan, device: Device, peak: float, constants: Constants) -> float:
    """The head's three products (bf16) and the loss over the vocabulary (the logits read and written in
    float32, forward and backward: 16 bytes a logit) for one micro-batch."""
    tokens = capacity.tokens(model, plan)
    vocab = model.vocab // plan.tp if plan.vocab_parallel else model.vocab
    e = 4 if plan.precision == "fp32" else 2
    rate = peak * device.matmul_ceiling * constants.sustained
    h = model.hidden
    products = sum(matmul_seconds(m, n, k, device, rate, constants.k0, e)
                   for m, n, k in ((tokens, vocab, h), (tokens, h, vocab), (h, vocab, tokens)))
    return products + 16.0 * tokens * vocab / device.memory_bytes_per_s


def optimizer_seconds(model: ModelSpec, plan: Plan, device: Device) -> float:
    """Adam's update of rank 0's parameters (its ZeRO shard): read the float32 master weights, gradients,
    momentum and variance, write the first three and the bf16 copy (30 bytes a parameter; fp32: 28)."""
    count = sum(capacity.shard(c, r) if plan.zero >= 1 else c for c, r in capacity.buffers(model, plan))
    return (28 if plan.precision == "fp32" else 30) * count / device.memory_bytes_per_s


# --- the step ---------------------------------------------------------------------------------------------


@dataclass
class Breakdown:
    step: StepTime                 # 42's terms: compute_s holds every term of the compute below
    matmul_s: float                # the linear maps (the head's too)
    attention_s: float
    memory_s: float                # work bound by memory, float8's casts, the optimizer's update
    hidden_tp_s: float             # tensor-parallel traffic under the layers' products (not in tp_s)
    straggler_s: float             # waiting for the slowest rank
    hidden_pp_s: float = 0.0       # pipeline sends beside the compute (pp_overlap; not in pp_s)


def ring_bandwidth(plan: Plan, cluster: Cluster, dimension: str, name: str) -> float:
    """The bandwidth a rank's ring runs at. Inside a node, NVLink's. Across nodes, each GPU has a network
    card of its own: a ring over the group's g members in each node is g rings at once (NCCL's channels),
    each carrying 1/g of the buffer through another card, so a rank moves data at g cards' bandwidth, no
    more than NVLink's (the hops inside the node carry all of it). A send or an all-to-all crosses on the
    rank's own card."""
    return _ring_bandwidth(plan, cluster, dimension, name, capacity.link(cluster, plan, dimension)[0])


def _ring_bandwidth(plan: Plan, cluster: Cluster, dimension: str, name: str, bandwidth: float) -> float:
    if bandwidth == cluster.intra_node_bandwidth or name not in ("all-reduce", "reduce-scatter", "all-gather"):
        return bandwidth
    stride = capacity.group_span(plan, dimension) // capacity.group_size(plan, dimension)
    members = max(1, cluster.gpus_per_node // stride)
    return min(members * bandwidth, cluster.intra_node_bandwidth)


def collective_seconds(plan: Plan, cluster: Cluster, constants: Constants, dimension: str, name: str, calls: int,
                       size: float) -> float:
    """42's ring, at LINK_EFFICIENCY of the bandwidth its rings run at (``ring_bandwidth``)."""
    n = capacity.group_size(plan, dimension)
    bandwidth, latency = capacity.link(cluster, plan, dimension)
    bandwidth = _ring_bandwidth(plan, cluster, dimension, name, bandwidth)
    return calls * (size * capacity.ring_factor(name, n) / (bandwidth * constants.link_efficiency)
                    + capacity.latency_steps(name, n) * latency)


def overlapped_tp(model: ModelSpec, plan: Plan, cluster: Cluster, constants: Constants) -> float:
    """One layer's tensor-parallel collectives of backward that need not wait, per micro-batch: the input's
    gradient reduced (all-reduce, or reduce-scatter with sequence parallelism) and, with sequence
    parallelism, the input gathered again for the weight's gradient, at each of the two blocks (Megatron-
    LM's asynchronous tensor-parallel communication; Korthikanti et al. 2022, section 4.2.2)."""
    if plan.tp == 1 or not plan.tp_overlap:
        return 0.0
    activation = capacity.element_bytes(plan) * capacity.tokens(model, plan) * model.hidden
    calls = [("tp", "all-gather", 2, activation), ("tp", "reduce-scatter", 2, activation)] if plan.sp else \
        [("tp", "all-reduce", 2, activation)]
    return sum(collective_seconds(plan, cluster, constants, *c) for c in calls)


@functools.lru_cache(maxsize=8192)
def _layers(model: ModelSpec, plan: Plan, cluster: Cluster, kind: str, constants: Constants) -> dict:
    """{is_moe: (LayerCost, critical seconds, hidden tensor-parallel seconds)} of one layer and micro-batch."""
    device, peak = device_of(kind), _peak(plan, cluster)
    out = {}
    for moe, i in {capacity.is_moe(model, i): i for i in range(model.layers)}.items():
        cost = layer_cost(model, plan, device, peak, constants, i)
        entries = capacity.layer_collectives(model, plan, i)
        comm = sum(collective_seconds(plan, cluster, constants, *entry) for entry in entries)
        if plan.tp_comm_overlap:  # every tensor-parallel collective beside the product it feeds or follows
            hidden = min(sum(collective_seconds(plan, cluster, constants, *entry) for entry in entries
                             if entry[0] == "tp"), cost.matmul_s)
        else:
            hidden = min(overlapped_tp(model, plan, cluster, constants), cost.weight_grad_s)
        out[moe] = (cost, comm - hidden, hidden)
    return out


def _layer_plan(plan: Plan) -> Plan:
    """What of ``plan`` one layer's cost depends on (the cache's key): not dp, pp, ZeRO or the micro-batches."""
    return Plan(dp=plan.ep, tp=plan.tp, micro_batch=plan.micro_batch, precision=plan.precision,
                recompute=plan.recompute, sp=plan.sp, cp=plan.cp, vocab_parallel=plan.vocab_parallel,
                attention=plan.attention, ep=plan.ep, capacity_factor=plan.capacity_factor, cp_comm=plan.cp_comm,
                tp_overlap=plan.tp_overlap, tp_comm_overlap=plan.tp_comm_overlap)


@functools.lru_cache(maxsize=4096)
def _rank_kinds(model: ModelSpec, layout: tuple, pp: int) -> list[dict]:
    """For each pipeline rank, {is_moe: how many of its layers}."""
    out = [{} for _ in range(pp)]
    start = 0
    for j, n in enumerate(layout):
        for i in range(start, start + n):
            moe = capacity.is_moe(model, i)
            out[j % pp][moe] = out[j % pp].get(moe, 0) + 1
        start += n
    return out


@functools.lru_cache(maxsize=1024)
def _head(model: ModelSpec, plan: Plan, cluster: Cluster, kind: str, constants: Constants) -> float:
    return head_seconds(model, plan, device_of(kind), _peak(plan, cluster), constants)


@functools.lru_cache(maxsize=1024)
def slowest_of(n: int) -> float:
    """How many spreads the slowest of ``n`` normal variables is, on average, behind their mean: Blom's
    approximation of the largest of n, the normal quantile at (n - 0.375) / (n + 0.25): 1.434 at 8 (exact
    1.4236, the figure JITTER was measured with), 3.03 at 512, 3.96 at 16,384, within 1 % from 8 ranks up;
    sqrt(2 ln n), its limit, says 2.04, 3.53 and 4.41)."""
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


def _peak(plan: Plan, cluster: Cluster) -> float:
    return cluster.peak_flops * (0.5 if plan.precision == "fp32" else 1.0)


def step_time(model: ModelSpec, plan: Plan, cluster: Cluster, kind: str, constants: Constants = FITTED) -> StepTime:
    return breakdown(model, plan, cluster, kind, constants).step


def breakdown(model: ModelSpec, plan: Plan, cluster: Cluster, kind: str, constants: Constants = FITTED) -> Breakdown:
    """Rank 0's step on ``cluster``, a cluster of ``kind`` GPUs (a key of DEVICES). busy: its compute and the
    communication on its critical path; the bubble and the pace of the busiest pipeline rank as 42's; the
    data-parallel traffic compute does not hide; the optimizer's update; the wait for the slowest rank."""
    capacity.validate(model, plan, cluster.gpus)
    device = device_of(kind)
    if plan.precision == "fp8-mixed" and not device.fp8_flops:
        raise PlanError(f"fp8-mixed needs float8 tensor cores: the {kind} has none")
    m = plan.micro_batches
    per_layer = _layer_plan(plan)
    layers = _layers(model, per_layer, cluster, kind, constants)
    counts = _rank_kinds(model, capacity.layout(model, plan), plan.pp)
    mine = counts[0]
    head = head_seconds(model, plan, device, _peak(plan, cluster), constants) if plan.pp == 1 else 0.0
    optimizer = optimizer_seconds(model, plan, device)
    compute_s = m * (sum(n * layers[moe][0].total() for moe, n in mine.items()) + head) + optimizer
    hidden_tp = m * sum(n * layers[moe][2] for moe, n in mine.items())
    seconds = dict.fromkeys(capacity.DIMENSIONS, 0.0)
    data = []
    for entry in capacity.collective_list(model, plan):
        seconds[entry[0]] += collective_seconds(plan, cluster, constants, *entry)
        if entry[0] in ("dp", "edp"):
            data.append(entry)
    hidden_pp = seconds["pp"] if plan.pp_overlap else 0.0
    busy = compute_s + seconds["tp"] - hidden_tp + seconds["pp"] - hidden_pp + seconds["cp"] + seconds["ep"]
    paces = [sum(n * (layers[moe][0].total() + layers[moe][1]) for moe, n in rank.items()) for rank in counts]
    if plan.pp > 1:  # the last rank also runs the head and the loss for every micro-batch
        paces[-1] += _head(model, per_layer, cluster, kind, constants)
    extra = max(0.0, max(paces) - paces[0])  # per micro-batch: the busiest rank's work sets the pace
    bubble_s = (busy + m * extra) * (plan.pp - 1) / (m * plan.vpp) + m * extra
    exposed = exposed_data_parallel(plan, cluster, constants, data, compute_s - optimizer)
    straggler = (busy + bubble_s) * constants.jitter * slowest_of(plan.world_size)
    step = StepTime(float(capacity.flops(model, plan)), compute_s, seconds["dp"] + seconds["edp"],
                    seconds["tp"] - hidden_tp, seconds["pp"] - hidden_pp, bubble_s, exposed,
                    busy + bubble_s + exposed + straggler, seconds["cp"], seconds["ep"])
    def part(name: str) -> float:
        return m * sum(n * getattr(layers[moe][0], name) for moe, n in mine.items())

    loss = 16.0 * capacity.tokens(model, plan) * (model.vocab // plan.tp if plan.vocab_parallel else model.vocab) \
        / device.memory_bytes_per_s if plan.pp == 1 else 0.0
    return Breakdown(step, part("matmul_s") + m * (head - loss), part("attention_s"),
                     part("memory_s") + m * loss + optimizer, hidden_tp, straggler, hidden_pp)


def exposed_data_parallel(plan: Plan, cluster: Cluster, constants: Constants, data: list, compute_s: float) -> float:
    """Data-parallel traffic compute does not hide. Without overlap (dp_overlap False) all of it. With it,
    a gradient reduction runs behind the backwards from the first chunk's last backward to the end (ZeRO 0
    and 1: one reduction a step, bucket by bucket; ZeRO 2 and 3: one after each micro-batch, behind every
    the compute after the first backward); a parameter gather behind the forwards up to the last chunk's first
    forward (ZeRO 1 and 2: the next step's; ZeRO 3: before each forward and backward, behind all of the
    compute)."""
    forward_share = 0.25 if plan.recompute == "full" else 1 / 3
    reduce_passes, gather_passes = _windows(plan)
    one_pass = compute_s / (plan.micro_batches * plan.vpp)  # one chunk's forward and backward of a micro-batch
    exposed = 0.0
    for dimension, name, calls, size in data:
        seconds = collective_seconds(plan, cluster, constants, dimension, name, calls, size)
        if not plan.dp_overlap:
            window = 0.0
        elif plan.zero >= 3 and name == "all-gather":
            window = compute_s
        elif plan.zero >= 2 and name == "reduce-scatter":  # each after a backward, behind all that follows it
            window = compute_s - one_pass * forward_share
        elif name == "all-gather":
            window = one_pass * forward_share * gather_passes
        else:
            window = one_pass * (1 - forward_share) * reduce_passes
        exposed += max(0.0, seconds - window)
    return exposed


@functools.lru_cache(maxsize=1024)
def _windows(plan: Plan) -> tuple[int, int]:
    """Chunk passes of rank 0's schedule a step's gradient reduction and parameter gather can run behind:
    the backwards from the first chunk to finish its last backward to the end (that one included), the
    forwards from the start to the last chunk to begin its first forward (that one included)."""
    ops = capacity.schedule(plan, 0)
    last_backward, first_forward = {}, {}
    for i, (op, _, chunk) in enumerate(ops):
        if op == "B":
            last_backward[chunk] = i
        else:
            first_forward.setdefault(chunk, i)
    start, end = min(last_backward.values()), max(first_forward.values())
    return sum(op == "B" for op, _, _ in ops[start:]), sum(op == "F" for op, _, _ in ops[:end + 1])
