"""Exercise 42: napkin math, part 2: what each GPU sends, and how long a step takes.

    communication(model: ModelSpec, plan: Plan) -> Traffic
    step_time(model: ModelSpec, plan: Plan, cluster: Cluster) -> StepTime

The transformer, the plan and rank 0 are exercise 41's (read its docstring and its
Transformer): rank 0 is the first pipeline stage, tensor-parallel rank 0,
data-parallel rank 0, and ranks are ordered tensor-parallel innermost, then data,
then pipeline: rank = (pp_index * dp + dp_index) * tp + tp_index. e is the element
size of the parameters, gradients and activations (2 under "bf16-mixed", 4 under "fp32").

communication: the bytes rank 0 sends in one step, per parallel dimension ("dp", "tp",
"pp": Traffic's fields) and per collective ("all-reduce", "reduce-scatter",
"all-gather", "send": the keys of each dict; leave out what is not sent). Collectives
run as rings: over n ranks a rank sends 2(n-1)/n of the buffer in an all-reduce and
(n-1)/n of the whole buffer in a reduce-scatter or an all-gather; a send sends it all.
What runs, per step:
  - dp (only when dp > 1), over the flat buffer of rank 0's local parameters (P
    elements; for ZeRO padded to dp * ceil(P / dp)):
      ZeRO 0: one all-reduce of the gradients (P elements, not padded);
      ZeRO 1: one reduce-scatter of the gradients, then one all-gather of the updated
              parameters;
      ZeRO 2: a reduce-scatter after every micro-batch's backward (the whole gradient is
              not kept), then one all-gather of the updated parameters;
      ZeRO 3: an all-gather of the parameters before every micro-batch's forward and
              again before its backward, a reduce-scatter after it; no all-gather after
              the step.
  - tp (only when tp > 1): per layer and micro-batch, two all-reduces of the
    activations (micro_batch x seq_len x hidden elements) in forward, after out and
    after fc2, and their two conjugates in backward, before QKV and fc1; a layer
    recomputed whole ("full") runs its forward's two again.
  - pp (only when pp > 1): the first stage sends one activation (micro_batch x
    seq_len x hidden) per micro-batch (it receives the gradients, it does not send them).

step_time: one step of rank 0 on `cluster`:
  flops        the matmul FLOPs rank 0 computes (what torch.utils.flop_counter counts):
               a forward of one layer on one micro-batch is 2 b s (12 h^2) + 4 b s^2 h
               (QK^T and times V), divided by tp; a backward is twice its forward;
               "full" recomputes each layer's forward once more, "selective" the 4 b s^2 h
               of the attention core. The head (h x V, on the last stage, whole on every
               tensor-parallel rank) costs 2 b s h V forward and twice that backward;
               embeddings are lookups.
  compute_s    flops / (peak_flops * mfu), and at half that rate under "fp32"
  dp_s, tp_s, pp_s   the time of that dimension's collectives: for each call,
               bytes sent / bandwidth + latency * (messages in sequence: 2(n-1) for an
               all-reduce, n-1 for a reduce-scatter or all-gather, 1 for a send). A group
               uses the node's links when its ranks fit in one node (a tp group spans tp
               consecutive ranks, a dp group tp * dp, a pp group tp * dp * pp; compare
               with gpus_per_node), and the links between nodes otherwise.
  bubble_s     a pipeline idles (pp - 1) / (micro_batches + pp - 1) of its time (GPipe and
               1F1B alike): with busy = compute_s + tp_s + pp_s, bubble_s = busy *
               (pp - 1) / micro_batches.
  exposed_dp_s data-parallel communication overlaps compute: only max(0, dp_s - compute_s)
               adds to the step.
  total_s      busy + bubble_s + exposed_dp_s
A plan that cannot run raises ValueError (41's reasons), and step_time also when
dp * tp * pp is not cluster.gpus.

The traffic and time of 41's GPT-style plans. Frontier runs add sequence parallelism
(all-gathers and reduce-scatters where tensor parallelism all-reduces), context
parallelism (K and V gathered), interleaved stages (a bubble divided by the virtual
stages, more sends), uneven stages (the busiest stage sets the pace) and experts
(all-to-alls); the exercise leaves them out to stay an hour's work. Once 41 and 42
pass, `ddp-grade plan` costs them with the same counts and adds what one efficiency
hides (each matmul's efficiency from its shape, memory-bound work, the traffic compute
cannot hide, the slowest of many ranks); `ddp-grade plan --published` shows it beside
published runs it was not fitted to, and `--compute-efficiency` gives your model's
answer. docs/capacity.md says each term.

Grade it:  ddp-grade exercises/42_traffic.py
The grader runs a dozen plans for real on 2 to 4 processes and compares your bytes
with every collective each rank made (exactly) and your FLOPs with FlopCounterMode's,
then your step times with the kit's cost model at scale (GPipe's bubble, the ring's
2(n-1)/n).
"""

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
        getattr(traffic, dimension)[name] = calls * size * ring_share(name, n)
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
    return StepTime(flops, compute_s, seconds["dp"], seconds["tp"], seconds["pp"], bubble_s, exposed_dp_s,
                    busy + bubble_s + exposed_dp_s)
