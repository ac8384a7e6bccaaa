"""Exercise 42, right, another style: the step simulated as a list of events (each collective rank 0
makes, in order, micro-batch by micro-batch), then summed and timed event by event."""


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


def validate(model: ModelSpec, plan: Plan) -> None:
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
    validate(model, plan)
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
    validate(model, plan)
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
