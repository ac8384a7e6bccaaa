"""Exercise 43, wrong on purpose. Tensor parallelism up to 16, whatever the node: across nodes where it looks faster."""
# expect-fail: plan-allowed
# expect-pass: plan-fits plan-near-fastest nothing-fits-refused uneven-batch-refused


import itertools
import math
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    peak_flops: float            # per GPU, dense bf16, FLOP/s
    mfu: float                   # the fraction of peak compute achieves
    memory_bytes: float          # per GPU
    intra_node_bandwidth: float  # bytes/s a GPU sends to a GPU of its node
    inter_node_bandwidth: float  # bytes/s a GPU sends to a GPU of another node
    intra_node_latency: float    # seconds per message inside a node
    inter_node_latency: float    # seconds per message between nodes


@dataclass
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    activations: float
    total: float


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


def collectives(model: ModelSpec, plan: Plan) -> list:
    """Rank 0's collectives in one step: (dimension, name, group size, calls, bytes of the whole buffer)."""
    check(model, plan)
    L, h, V, s = model.layers, model.hidden, model.vocab, model.seq_len
    d, t, p, m, b = plan.dp, plan.tp, plan.pp, plan.micro_batches, plan.micro_batch
    e = 2 if plan.precision == "bf16-mixed" else 4
    count = L // p * (12 * h * h // t + 7 * h // t + 6 * h) + V * h + s * h
    if p == 1:
        count += 2 * h + h * V
    padded = d * math.ceil(count / d)
    activation = e * b * s * h
    found = []
    if d > 1 and plan.zero == 0:
        found.append(("dp", "all-reduce", d, 1, e * count))
    if d > 1 and plan.zero in (1, 2):
        found.append(("dp", "reduce-scatter", d, m if plan.zero == 2 else 1, e * padded))
        found.append(("dp", "all-gather", d, 1, e * padded))
    if d > 1 and plan.zero == 3:
        found.append(("dp", "all-gather", d, 2 * m, e * padded))      # before each forward and each backward
        found.append(("dp", "reduce-scatter", d, m, e * padded))
    if t > 1:
        per_layer = 6 if plan.recompute == "full" else 4              # 2 forward, 2 backward, 2 recomputed
        found.append(("tp", "all-reduce", t, m * L // p * per_layer, activation))
    if p > 1:
        found.append(("pp", "send", p, m, activation))
    return found


def ring_share(name: str, n: int) -> float:
    """What one rank sends in a ring collective over n ranks, per byte of the whole buffer."""
    return {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": (n - 1) / n,
            "all-gather": (n - 1) / n, "send": 1.0}[name]


def step_time(model: ModelSpec, plan: Plan, cluster: Cluster) -> StepTime:
    check(model, plan)
    if plan.dp * plan.tp * plan.pp != cluster.gpus:
        raise ValueError(f"dp x tp x pp = {plan.dp * plan.tp * plan.pp}, not the cluster's {cluster.gpus} GPUs")
    L, h, V, s = model.layers, model.hidden, model.vocab, model.seq_len
    t, p, m, b = plan.tp, plan.pp, plan.micro_batches, plan.micro_batch

    # 1. FLOPs: forward + backward (twice the forward), plus what is recomputed.
    layer_forward = (24 * b * s * h * h + 4 * b * s * s * h) // t
    per_micro = 3 * L // p * layer_forward
    if plan.recompute == "full":
        per_micro += L // p * layer_forward
    if plan.recompute == "selective":
        per_micro += L // p * (4 * b * s * s * h // t)
    if p == 1:
        per_micro += 6 * b * s * h * V                               # the head, on the last stage
    flops = m * per_micro
    rate = cluster.peak_flops * cluster.mfu * (1.0 if plan.precision == "bf16-mixed" else 0.5)
    compute_s = flops / rate

    # 2. Communication: each call on its group's link, bandwidth plus latency per message in sequence.
    span = {"tp": t, "dp": t * plan.dp, "pp": t * plan.dp * p}
    seconds = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    for dimension, name, n, calls, size in collectives(model, plan):
        inside = span[dimension] <= cluster.gpus_per_node
        bandwidth = cluster.intra_node_bandwidth if inside else cluster.inter_node_bandwidth
        latency = cluster.intra_node_latency if inside else cluster.inter_node_latency
        messages = {"all-reduce": 2 * (n - 1), "send": 1}.get(name, n - 1)
        seconds[dimension] += calls * (size * ring_share(name, n) / bandwidth + messages * latency)

    # 3. The bubble, and the data-parallel time compute does not hide.
    busy = compute_s + seconds["tp"] + seconds["pp"]
    bubble_s = busy * (p - 1) / m
    exposed_dp_s = max(0.0, seconds["dp"] - compute_s)
    return StepTime(flops, compute_s, seconds["dp"], seconds["tp"], seconds["pp"], bubble_s, exposed_dp_s,
                    busy + bubble_s + exposed_dp_s)


def choose_plan(model: ModelSpec, cluster: Cluster, global_batch_tokens: int) -> Plan:
    if global_batch_tokens % model.seq_len:
        raise ValueError(f"{global_batch_tokens} tokens are not a whole number of {model.seq_len}-token sequences")
    sequences = global_batch_tokens // model.seq_len

    # 1. Every plan the rules allow.
    plans = []
    pipeline_sizes = [p for p in range(1, model.layers + 1) if model.layers % p == 0]
    for tp, pp in itertools.product((1, 2, 4, 8, 16), pipeline_sizes):
        if model.heads % tp or cluster.gpus % (tp * pp):
            continue
        dp = cluster.gpus // (tp * pp)
        for micro_batch in (1, 2, 4, 8):
            if sequences % (dp * micro_batch):
                continue
            micro_batches = sequences // (dp * micro_batch)
            for zero, schedule, recompute in itertools.product(range(4), ("gpipe", "1f1b"), ("none", "selective", "full")):
                if zero >= 2 and pp > 1:
                    continue
                plans.append(Plan(dp, tp, pp, zero, micro_batch, micro_batches, schedule, "bf16-mixed", recompute))

    # 2. Those that fit; the fastest of them.
    fitting = [plan for plan in plans if training_memory(model, plan).total <= cluster.memory_bytes]
    if not fitting:
        raise ValueError(f"no plan fits {model} in {cluster.memory_bytes / 1e9:.0f} GB per GPU on {cluster.gpus} GPUs")
    return min(fitting, key=lambda plan: step_time(model, plan, cluster).total_s)
