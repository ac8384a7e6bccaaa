"""Exercise 42, wrong on purpose. Every figure is NaN once the plan is checked (traffic, FLOPs, seconds): NaN
compares false with everything, so a grader that only asks whether the estimate is too far off would pass it;
bad plans are still refused."""
# expect-fail: traffic-measured
# expect-fail: flops-measured
# expect-fail: ring-factor
# expect-fail: bubble
# expect-fail: step-time-model
# expect-pass: bad-plans-refused


import math
from dataclasses import dataclass, field


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
class Traffic:
    dp: dict = field(default_factory=dict)   # {"all-reduce": bytes, ...} rank 0 sends per step
    tp: dict = field(default_factory=dict)
    pp: dict = field(default_factory=dict)


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


def communication(model: ModelSpec, plan: Plan) -> Traffic:
    traffic = Traffic()
    for dimension, name, n, calls, size in collectives(model, plan):
        getattr(traffic, dimension)[name] = float("nan")
    return traffic


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
    nan = float("nan")
    return StepTime(nan, nan, nan, nan, nan, nan, nan, nan)
