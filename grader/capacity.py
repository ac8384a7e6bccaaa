"""The kit's cost model of a parallel training plan (exercises 41-43, `ddp-grade plan`, the
capacity quiz): bytes each rank holds, bytes it sends, FLOPs it computes and the time of a step.

Pure Python, no torch. Every formula here is the one the stubs of 41-43 state, and
``tests/test_capacity_measured.py`` holds it against what real runs of the same transformer
measure (storages alive, bytes autograd saves, each collective's payload, FlopCounterMode), so the
reference cannot drift from what PyTorch does.

The transformer (GPT-style, untied head, no bias in the head):
    token embedding V x h, position embedding s x h,
    L layers of: LayerNorm, fused QKV Linear(h, 3h), attention (softmax, dropout on the
    probabilities), out Linear(h, h), dropout, residual; LayerNorm, Linear(h, 4h), GELU,
    Linear(4h, h), dropout, residual;
    final LayerNorm, head Linear(h, V, bias=False).

Rank order (Megatron's): tensor-parallel ranks innermost, then data-parallel, then pipeline:
    rank = (pp_index * dp + dp_index) * tp + tp_index.
Rank 0 (first stage, tensor rank 0, data rank 0) is the rank every figure describes.

Sources: Rajbhandari et al. 2020 (ZeRO, section 3 and figure 1), Korthikanti et al. 2022
(activation memory, table 2), Narayanan et al. 2021 (pipeline bubble), Kaplan et al. 2020
(6 FLOPs per parameter per token), Patarasuk and Yuan 2009 (ring all-reduce 2(n-1)/n).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass, field, fields

SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("bf16-mixed", "fp32")
RECOMPUTES = ("none", "selective", "full")
DIMENSIONS = ("dp", "tp", "pp")
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "send")


@dataclass(frozen=True)
class ModelSpec:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int


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

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    peak_flops: float            # per GPU, dense bf16, FLOP/s (fp32 plans compute at half: TF32)
    mfu: float                   # the fraction of peak that compute achieves
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

    def total(self) -> float:
        return sum(sum(d.values()) for d in (self.dp, self.tp, self.pp))


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


class PlanError(ValueError):
    """A plan that cannot run on this model (sizes that do not divide, a combination refused)."""


# --- checks on input -----------------------------------------------------------------------------------


def validate(model: ModelSpec, plan: Plan, world_size: int | None = None) -> None:
    """Raise PlanError, saying what and why, when ``plan`` cannot run ``model``."""
    for name in ("layers", "hidden", "heads", "vocab", "seq_len"):
        if getattr(model, name) < 1:
            raise PlanError(f"model.{name} must be at least 1, not {getattr(model, name)}")
    if model.hidden % model.heads:
        raise PlanError(f"hidden {model.hidden} is not divisible by heads {model.heads}")
    for name in ("dp", "tp", "pp", "micro_batch", "micro_batches"):
        if getattr(plan, name) < 1:
            raise PlanError(f"plan.{name} must be at least 1, not {getattr(plan, name)}")
    if plan.zero not in (0, 1, 2, 3):
        raise PlanError(f"plan.zero must be 0, 1, 2 or 3, not {plan.zero}")
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"plan.schedule must be one of {', '.join(SCHEDULES)}, not {plan.schedule!r}")
    if plan.precision not in PRECISIONS:
        raise PlanError(f"plan.precision must be one of {', '.join(PRECISIONS)}, not {plan.precision!r}")
    if plan.recompute not in RECOMPUTES:
        raise PlanError(f"plan.recompute must be one of {', '.join(RECOMPUTES)}, not {plan.recompute!r}")
    if model.layers % plan.pp:
        raise PlanError(f"{plan.pp} pipeline stages do not divide {model.layers} layers")
    if model.heads % plan.tp:
        raise PlanError(f"tensor-parallel size {plan.tp} does not divide {model.heads} heads")
    if plan.zero >= 2 and plan.pp > 1:
        raise PlanError(f"ZeRO stage {plan.zero} with {plan.pp} pipeline stages is refused: gradients "
                        "sharded over data-parallel ranks would be reduced once per micro-batch per stage")
    if world_size is not None and plan.world_size != world_size:
        raise PlanError(f"dp x tp x pp = {plan.dp} x {plan.tp} x {plan.pp} = {plan.world_size}, "
                        f"not the world size {world_size}")


# --- counts ---------------------------------------------------------------------------------------------


def layer_params(model: ModelSpec, tp: int) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank.

    Split (Megatron): QKV and fc1 by output features (weight and bias), out and fc2 by input
    features (weight; their biases whole), both LayerNorms whole."""
    h = model.hidden
    return 12 * h * h // tp + 7 * h // tp + 6 * h


def stage_params(model: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """Parameters one rank of pipeline stage ``stage`` holds before any ZeRO sharding.
    The embeddings sit on the first stage, the final norm and the head on the last; under
    tensor parallelism they stay whole on every tensor-parallel rank."""
    h, V, s = model.hidden, model.vocab, model.seq_len
    count = model.layers // plan.pp * layer_params(model, plan.tp)
    if stage == 0:
        count += V * h + s * h
    if stage == plan.pp - 1:
        count += 2 * h + h * V
    return count


def total_params(model: ModelSpec) -> int:
    return stage_params(model, Plan())


def shard(count: int, ranks: int) -> int:
    """Elements each rank keeps of a flat buffer of ``count`` padded to a multiple of ``ranks``."""
    return -(-count // ranks)


def element_bytes(plan: Plan) -> int:
    """Bytes of one element of the parameters that compute, their gradients and the activations."""
    return 2 if plan.precision == "bf16-mixed" else 4


def optimizer_bytes_per_param(plan: Plan) -> int:
    """Adam's momentum and variance in float32, plus the float32 master weights under bf16-mixed."""
    return 12 if plan.precision == "bf16-mixed" else 8


# --- exercise 41: memory ----------------------------------------------------------------------------------


def layer_activations(model: ModelSpec, plan: Plan) -> int:
    """Bytes one layer keeps for backward for one micro-batch (Korthikanti et al. 2022 table 2,
    for any element size e; masks are 1 byte)."""
    s, b, h, a = model.seq_len, plan.micro_batch, model.hidden, model.heads
    e, t = element_bytes(plan), plan.tp
    if plan.recompute == "full":
        return e * s * b * h  # the layer's input only
    replicated = (4 * e + 2) * s * b * h  # both norms' inputs, QKV's and fc1's inputs, two dropout masks
    split = 12 * e * s * b * h // t  # Q, K, V, out's input, GELU's input and output
    if plan.recompute == "selective":
        return replicated + split
    return replicated + split + (2 * e + 1) * a * s * s * b // t  # softmax out, mask, dropout out


def in_flight(plan: Plan, stage: int = 0) -> int:
    """Micro-batches whose activations a stage holds at its peak: GPipe runs every forward first,
    1F1B at most as many as stages lie from this one to the last."""
    if plan.schedule == "gpipe":
        return plan.micro_batches
    return min(plan.pp - stage, plan.micro_batches)


def training_memory(model: ModelSpec, plan: Plan) -> MemoryBreakdown:
    validate(model, plan)
    count = stage_params(model, plan, 0)
    e = element_bytes(plan)
    sharded = shard(count, plan.dp)
    params = e * (sharded if plan.zero >= 3 else count)
    grads = e * (sharded if plan.zero >= 2 else count)
    optimizer = optimizer_bytes_per_param(plan) * (sharded if plan.zero >= 1 else count)
    activations = model.layers // plan.pp * layer_activations(model, plan) * in_flight(plan, 0)
    return MemoryBreakdown(params, grads, optimizer, activations, params + grads + optimizer + activations)


# --- exercise 42: traffic and time ------------------------------------------------------------------------


def ring_factor(collective: str, n: int) -> float:
    """Bytes a rank sends in a ring collective over ``n`` ranks, per byte of the whole buffer."""
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": (n - 1) / n, "all-gather": (n - 1) / n,
            "send": 1.0}[collective]


def collectives(model: ModelSpec, plan: Plan) -> dict:
    """Every collective rank 0 takes part in per step: (dimension, collective) -> (calls, bytes of
    the whole buffer each call). The buffer of a reduce-scatter and an all-gather is the padded
    flat buffer (dp x shard)."""
    validate(model, plan)
    d, t, p, m = plan.dp, plan.tp, plan.pp, plan.micro_batches
    e = element_bytes(plan)
    count = stage_params(model, plan, 0)
    padded = d * shard(count, d)
    out: dict = {}
    if d > 1:
        if plan.zero == 0:
            out[("dp", "all-reduce")] = (1, e * count)
        elif plan.zero in (1, 2):
            calls = m if plan.zero == 2 else 1  # sharded gradients cannot wait for the last micro-batch
            out[("dp", "reduce-scatter")] = (calls, e * padded)
            out[("dp", "all-gather")] = (1, e * padded)
        else:
            out[("dp", "all-gather")] = (2 * m, e * padded)  # before each forward and each backward
            out[("dp", "reduce-scatter")] = (m, e * padded)
    if t > 1:
        per_layer = 6 if plan.recompute == "full" else 4  # 2 forward (+2 recomputed), 2 backward
        activation = e * plan.micro_batch * model.seq_len * model.hidden
        out[("tp", "all-reduce")] = (m * model.layers // p * per_layer, activation)
    if p > 1:
        activation = e * plan.micro_batch * model.seq_len * model.hidden
        out[("pp", "send")] = (m, activation)  # the first stage sends activations, receives gradients
    return out


def communication(model: ModelSpec, plan: Plan) -> Traffic:
    traffic = Traffic()
    for (dimension, name), (calls, size) in collectives(model, plan).items():
        n = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp}[dimension]
        getattr(traffic, dimension)[name] = calls * size * ring_factor(name, n)
    return traffic


def layer_flops(model: ModelSpec, plan: Plan) -> int:
    """Matmul FLOPs of one layer's forward for one micro-batch on one tensor-parallel rank."""
    s, b, h = model.seq_len, plan.micro_batch, model.hidden
    return (24 * b * s * h * h + 4 * b * s * s * h) // plan.tp


def flops(model: ModelSpec, plan: Plan) -> int:
    """FLOPs rank 0 computes per step: 3 x forward (backward is 2 x), recomputation added, the
    head's 6 b s h V on the last stage (rank 0's when pp == 1); embeddings are lookups."""
    validate(model, plan)
    s, b, h, V = model.seq_len, plan.micro_batch, model.hidden, model.vocab
    layers = model.layers // plan.pp
    per_micro = 3 * layers * layer_flops(model, plan)
    if plan.recompute == "full":
        per_micro += layers * layer_flops(model, plan)
    elif plan.recompute == "selective":
        per_micro += layers * 4 * b * s * s * h // plan.tp
    if plan.pp == 1:
        per_micro += 6 * b * s * h * V
    return plan.micro_batches * per_micro


def group_span(plan: Plan, dimension: str) -> int:
    """How many consecutive ranks one group of ``dimension`` spans (tp innermost, pp outermost)."""
    return {"tp": plan.tp, "dp": plan.tp * plan.dp, "pp": plan.tp * plan.dp * plan.pp}[dimension]


def link(cluster: Cluster, plan: Plan, dimension: str) -> tuple[float, float]:
    """(bandwidth, latency) of ``dimension``'s groups: inside a node when the group spans at most one."""
    if group_span(plan, dimension) <= cluster.gpus_per_node:
        return cluster.intra_node_bandwidth, cluster.intra_node_latency
    return cluster.inter_node_bandwidth, cluster.inter_node_latency


def latency_steps(collective: str, n: int) -> int:
    """Messages in sequence in a ring collective: 2(n-1) for an all-reduce, n-1 for the others."""
    return {"all-reduce": 2 * (n - 1), "reduce-scatter": n - 1, "all-gather": n - 1, "send": 1}[collective]


def step_time(model: ModelSpec, plan: Plan, cluster: Cluster) -> StepTime:
    validate(model, plan, cluster.gpus)
    work = flops(model, plan)
    rate = cluster.peak_flops * cluster.mfu * (1.0 if plan.precision == "bf16-mixed" else 0.5)
    compute_s = work / rate
    seconds = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    for (dimension, name), (calls, size) in collectives(model, plan).items():
        n = {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp}[dimension]
        bandwidth, latency = link(cluster, plan, dimension)
        seconds[dimension] += calls * (size * ring_factor(name, n) / bandwidth + latency_steps(name, n) * latency)
    busy = compute_s + seconds["tp"] + seconds["pp"]
    bubble_s = busy * (plan.pp - 1) / plan.micro_batches
    exposed = max(0.0, seconds["dp"] - compute_s)
    return StepTime(float(work), compute_s, seconds["dp"], seconds["tp"], seconds["pp"], bubble_s, exposed,
                    busy + bubble_s + exposed)


# --- exercise 43: the plan -------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in order (a square root's worth of trials: any --layers answers at once)."""
    small = [k for k in range(1, int(n ** 0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


MICRO_BATCHES = (1, 2, 4, 8)
TENSOR_PARALLEL = (1, 2, 4, 8)


def candidate_plans(model: ModelSpec, cluster: Cluster, global_batch_tokens: int):
    """Every plan 43 may choose from: bf16-mixed, tp in 1, 2, 4, 8 inside a node, pp a divisor of
    the layers, dp the rest of the GPUs, ZeRO 0-3, both schedules, every recomputation, micro-batch
    sizes 1, 2, 4, 8, and as many micro-batches as the global batch then needs."""
    if global_batch_tokens % model.seq_len:
        raise PlanError(f"global batch of {global_batch_tokens} tokens is not a whole number of "
                        f"{model.seq_len}-token sequences")
    sequences = global_batch_tokens // model.seq_len
    for tp, pp in itertools.product(TENSOR_PARALLEL, divisors(model.layers)):
        if tp > cluster.gpus_per_node or model.heads % tp or cluster.gpus % (tp * pp):
            continue
        dp = cluster.gpus // (tp * pp)
        for b in MICRO_BATCHES:
            if sequences % (dp * b):
                continue
            m = sequences // (dp * b)
            for zero, schedule, recompute in itertools.product((0, 1, 2, 3), SCHEDULES, RECOMPUTES):
                if zero >= 2 and pp > 1:
                    continue
                yield Plan(dp, tp, pp, zero, b, m, schedule, "bf16-mixed", recompute)


def fits(model: ModelSpec, plan: Plan, cluster: Cluster) -> bool:
    return training_memory(model, plan).total <= cluster.memory_bytes


@functools.lru_cache(maxsize=64)  # the arguments are frozen dataclasses: 43's report and checks ask twice
def best_plan(model: ModelSpec, cluster: Cluster, global_batch_tokens: int) -> Plan | None:
    """The fastest plan that fits, by exhaustive search (ties: fewer bytes, then the first found)."""
    best, key = None, None
    for plan in candidate_plans(model, cluster, global_batch_tokens):
        memory = training_memory(model, plan).total
        if memory > cluster.memory_bytes:
            continue
        candidate = (step_time(model, plan, cluster).total_s, memory)
        if key is None or candidate < key:
            best, key = plan, candidate
    return best


def limits(model: ModelSpec, plan: Plan, cluster: Cluster) -> list[str]:
    """What holds a plan back, in words: memory, the bubble, communication on a slow link."""
    memory = training_memory(model, plan)
    time = step_time(model, plan, cluster)
    said = []
    if memory.total > cluster.memory_bytes:
        said.append(f"memory: {memory.total / 1e9:.1f} GB does not fit in {cluster.memory_bytes / 1e9:.0f} GB")
    elif memory.total > 0.9 * cluster.memory_bytes:
        said.append(f"memory: {memory.total / 1e9:.1f} GB of {cluster.memory_bytes / 1e9:.0f} GB")
    share = lambda x: x / time.total_s if time.total_s else 0.0  # noqa: E731
    if share(time.bubble_s) >= 0.05:
        said.append(f"bubble: {share(time.bubble_s):.0%} of the step idle ({plan.pp} stages, "
                    f"{plan.micro_batches} micro-batches)")
    for dimension, seconds in (("tp", time.tp_s), ("pp", time.pp_s), ("dp", time.exposed_dp_s)):
        if share(seconds) >= 0.05:
            where = "across nodes" if link(cluster, plan, dimension)[0] == cluster.inter_node_bandwidth \
                and cluster.inter_node_bandwidth != cluster.intra_node_bandwidth else "inside a node"
            said.append(f"{dimension} communication {where}: {share(seconds):.0%} of the step")
    if plan.recompute != "none" and share(time.compute_s) > 0:
        said.append(f"recomputation ({plan.recompute}) adds compute")
    return said or ["compute"]


# --- scenarios ------------------------------------------------------------------------------------------

H100 = Cluster(gpus=64, gpus_per_node=8, peak_flops=989e12, mfu=0.4, memory_bytes=80e9,
               intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,
               intra_node_latency=5e-6, inter_node_latency=2e-5)


def on(cluster: Cluster, gpus: int) -> Cluster:
    return Cluster(**{**asdict(cluster), "gpus": gpus})


SCENARIOS = {  # 43's three: a model, its cluster, its global batch in tokens
    "8B on 64 GPUs": (ModelSpec(layers=32, hidden=4096, heads=32, vocab=128256, seq_len=8192), on(H100, 64), 4 * 2**20),
    "70B on 1,024 GPUs": (ModelSpec(layers=80, hidden=8192, heads=64, vocab=128256, seq_len=8192), on(H100, 1024),
                          4 * 2**20),
    "405B on 16,384 GPUs": (ModelSpec(layers=126, hidden=16384, heads=128, vocab=128256, seq_len=8192),
                            on(H100, 16384), 16 * 2**20),
}


def to_dict(value) -> dict:
    """A dataclass of this module as plain data."""
    return {f.name: getattr(value, f.name) for f in fields(value)}


