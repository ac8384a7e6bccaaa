"""Exercise 43, right, another style: plans as a generator, sorted by step time, the first that fits
taken (every plan is costed, but the memory of only as many as it takes); its memory and time
are written as an inventory of tensors and a list of events."""

import math
from dataclasses import dataclass, field
from itertools import product


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
class Traffic:
    dp: dict = field(default_factory=dict)
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


def validate_for_time(model: ModelSpec, plan: Plan) -> None:
    ok = (min(model.layers, model.hidden, model.heads, model.vocab, model.seq_len) >= 1
          and min(plan.dp, plan.tp, plan.pp, plan.micro_batch, plan.micro_batches) >= 1
          and model.hidden % model.heads == 0 and model.layers % plan.pp == 0 and model.heads % plan.tp == 0
          and plan.zero in (0, 1, 2, 3) and not (plan.zero > 1 and plan.pp > 1)
          and plan.schedule in ("gpipe", "1f1b") and plan.precision in ("bf16-mixed", "fp32")
          and plan.recompute in ("none", "selective", "full"))
    if not ok:
        raise ValueError(f"this plan cannot run this model: {plan} on {model}")


def local_parameters(model: ModelSpec, plan: Plan) -> int:
    h = model.hidden
    layer = (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) // plan.tp + (2 * h + h + 2 * h + h)
    n = model.layers // plan.pp * layer + (model.vocab + model.seq_len) * h
    return n + (2 * h + h * model.vocab if plan.pp == 1 else 0)


def events(model: ModelSpec, plan: Plan) -> list:
    """(dimension, collective, group size, bytes of the whole buffer), one per call, in order."""
    validate_for_time(model, plan)
    e = 2 if plan.precision == "bf16-mixed" else 4
    n = local_parameters(model, plan)
    flat = plan.dp * -(-n // plan.dp)
    act = e * plan.micro_batch * model.seq_len * model.hidden
    dp, tp, pp = ("dp", plan.dp), ("tp", plan.tp), ("pp", plan.pp)
    out = []
    for micro in range(plan.micro_batches):
        if plan.zero == 3:
            out.append((*dp, "all-gather", e * flat))
        for _ in range(model.layers // plan.pp):  # forward
            out += [(*tp, "all-reduce", act)] * 2
        if plan.pp > 1:
            out.append((*pp, "send", act))
        if plan.zero == 3:
            out.append((*dp, "all-gather", e * flat))
        for _ in range(model.layers // plan.pp):  # backward, a recomputed forward first
            out += [(*tp, "all-reduce", act)] * (4 if plan.recompute == "full" else 2)
        if plan.zero in (2, 3):
            out.append((*dp, "reduce-scatter", e * flat))
    if plan.zero == 0:
        out.append((*dp, "all-reduce", e * n))
    if plan.zero == 1:
        out.append((*dp, "reduce-scatter", e * flat))
    if plan.zero in (1, 2):
        out.append((*dp, "all-gather", e * flat))
    return [(dim, size, name, nbytes) for dim, size, name, nbytes in out if size > 1]


def sent(name: str, n: int, nbytes: float) -> float:
    if name == "send":
        return nbytes
    steps = 2 * (n - 1) if name == "all-reduce" else n - 1
    return steps * nbytes / n  # each of the ring's steps moves one n-th of the buffer


def communication(model: ModelSpec, plan: Plan) -> Traffic:
    traffic = Traffic()
    for dim, n, name, nbytes in events(model, plan):
        per = getattr(traffic, dim)
        per[name] = per.get(name, 0) + sent(name, n, nbytes)
    return traffic


def step_time(model: ModelSpec, plan: Plan, cluster: Cluster) -> StepTime:
    validate_for_time(model, plan)
    if plan.dp * plan.tp * plan.pp != cluster.gpus:
        raise ValueError(f"{plan.dp}*{plan.tp}*{plan.pp} GPUs planned, the cluster has {cluster.gpus}")
    b, s, h, a = plan.micro_batch, model.seq_len, model.hidden, model.heads
    dense = 2 * b * s * 12 * h * h // plan.tp
    attention = 4 * b * s * s * h // plan.tp
    per_layer = {"none": 3 * (dense + attention), "selective": 3 * (dense + attention) + attention,
                 "full": 4 * (dense + attention)}[plan.recompute]
    flops = plan.micro_batches * (model.layers // plan.pp * per_layer + (6 * b * s * h * model.vocab if plan.pp == 1 else 0))
    compute_s = flops / (cluster.peak_flops * cluster.mfu / (1 if plan.precision == "bf16-mixed" else 2))

    spans = {"tp": plan.tp, "dp": plan.tp * plan.dp, "pp": plan.tp * plan.dp * plan.pp}
    times = dict.fromkeys(spans, 0.0)
    for dim, n, name, nbytes in events(model, plan):
        near = spans[dim] <= cluster.gpus_per_node
        bw = cluster.intra_node_bandwidth if near else cluster.inter_node_bandwidth
        lat = cluster.intra_node_latency if near else cluster.inter_node_latency
        messages = 1 if name == "send" else (2 * (n - 1) if name == "all-reduce" else n - 1)
        times[dim] += sent(name, n, nbytes) / bw + messages * lat
    busy = compute_s + times["tp"] + times["pp"]
    bubble = busy * (plan.pp - 1) / plan.micro_batches
    exposed = max(times["dp"] - compute_s, 0.0)
    return StepTime(flops=flops, compute_s=compute_s, dp_s=times["dp"], tp_s=times["tp"], pp_s=times["pp"],
                    bubble_s=bubble, exposed_dp_s=exposed, total_s=busy + bubble + exposed)


def plans(model: ModelSpec, cluster: Cluster, sequences: int):
    stages = (p for p in range(1, model.layers + 1) if model.layers % p == 0)
    for pp, tp, b in product(list(stages), (1, 2, 4, 8), (1, 2, 4, 8)):
        if tp <= cluster.gpus_per_node and model.heads % tp == 0 and cluster.gpus % (tp * pp) == 0:
            dp = cluster.gpus // (tp * pp)
            if sequences % (dp * b) == 0:
                for zero, schedule, recompute in product((0, 1, 2, 3), ("1f1b", "gpipe"), ("none", "selective", "full")):
                    if zero < 2 or pp == 1:
                        yield Plan(dp, tp, pp, zero, b, sequences // (dp * b), schedule, "bf16-mixed", recompute)


def choose_plan(model: ModelSpec, cluster: Cluster, global_batch_tokens: int) -> Plan:
    sequences, rest = divmod(global_batch_tokens, model.seq_len)
    if rest:
        raise ValueError(f"{global_batch_tokens} is not a multiple of {model.seq_len}")
    by_speed = sorted(plans(model, cluster, sequences), key=lambda p: step_time(model, p, cluster).total_s)
    fitting = (p for p in by_speed if training_memory(model, p).total <= cluster.memory_bytes)
    choice = next(fitting, None)
    if choice is None:
        raise ValueError("no plan fits in memory")
    return choice
