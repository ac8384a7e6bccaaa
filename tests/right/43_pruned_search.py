"""Exercise 43, right, another style: every plan, largest tensor-parallel size and deepest pipeline first, and
for each the recomputations from the least memory to the most, stopping at the first that does not fit
(memory only grows from full to selective to none). Memory from a table of bytes per parameter in floats,
time from a small cost-model class."""


import dataclasses
import itertools
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


BYTES = {  # precision -> (param, grad, optimizer) bytes per parameter
    "bf16-mixed": (2.0, 2.0, 12.0),
    "fp32": (4.0, 4.0, 8.0),
}
SHARDED = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


def training_memory(model: ModelSpec, plan: Plan) -> MemoryBreakdown:
    assert_ok = [
        (model.layers % plan.pp == 0, "the stages must divide the layers"),
        (model.heads % plan.tp == 0, "tp must divide the heads"),
        (plan.zero in SHARDED, "ZeRO stage 0-3"),
        (not (plan.zero >= 2 and plan.pp > 1), "no ZeRO 2/3 with a pipeline"),
        (plan.schedule in ("gpipe", "1f1b"), "schedule"),
        (plan.precision in BYTES, "precision"),
        (plan.recompute in ("none", "selective", "full"), "recompute"),
        (min(plan.dp, plan.tp, plan.pp, plan.micro_batch, plan.micro_batches) >= 1, "sizes >= 1"),
    ]
    for ok, why in assert_ok:
        if not ok:
            raise ValueError(f"impossible plan {plan}: {why}")

    L, h, a, V, s = (float(x) for x in (model.layers, model.hidden, model.heads, model.vocab, model.seq_len))
    t, b, p = float(plan.tp), float(plan.micro_batch), float(plan.pp)
    n = (L / p) * (12 * h * h / t + 7 * h / t + 6 * h) + V * h + s * h + (2 * h + h * V if plan.pp == 1 else 0.0)
    n_shard = float(math.ceil(round(n) / plan.dp))
    per_param = dict(zip(("params", "grads", "optimizer"), BYTES[plan.precision]))
    terms = {k: v * (n_shard if k in SHARDED[plan.zero] else n) for k, v in per_param.items()}

    e = per_param["params"]
    if plan.recompute == "full":
        layer = e * s * b * h
    else:
        layer = s * b * h * (4 * e + 2 + 12 * e / t)
        if plan.recompute == "none":
            layer += (2 * e + 1) * a * s * s * b / t
    live = float(plan.micro_batches) if plan.schedule == "gpipe" else float(min(plan.pp, plan.micro_batches))
    out = MemoryBreakdown(**terms, activations=layer * (L / p) * live, total=0.0)
    return dataclasses.replace(out, total=out.params + out.grads + out.optimizer + out.activations)


class CostModel:
    RING = {"all-reduce": lambda n: 2 * (n - 1) / n, "reduce-scatter": lambda n: (n - 1) / n,
            "all-gather": lambda n: (n - 1) / n, "send": lambda n: 1.0}
    HOPS = {"all-reduce": lambda n: 2 * (n - 1), "reduce-scatter": lambda n: n - 1,
            "all-gather": lambda n: n - 1, "send": lambda n: 1}

    def __init__(self, model: ModelSpec, plan: Plan):
        try:
            assert min(plan.dp, plan.tp, plan.pp, plan.micro_batch, plan.micro_batches) > 0, "sizes"
            assert min(model.layers, model.hidden, model.heads, model.vocab, model.seq_len) > 0, "model sizes"
            assert model.layers % plan.pp == 0, "pp must divide the layers"
            assert model.heads % plan.tp == 0 and model.hidden % model.heads == 0, "tp must divide the heads"
            assert plan.zero in range(4) and (plan.zero < 2 or plan.pp == 1), "ZeRO stage"
            assert plan.schedule in ("gpipe", "1f1b"), "schedule"
            assert plan.precision in ("bf16-mixed", "fp32"), "precision"
            assert plan.recompute in ("none", "selective", "full"), "recompute"
        except AssertionError as exc:
            raise ValueError(f"bad plan: {exc}") from None
        self.m, self.p = model, plan
        self.e = 2.0 if plan.precision == "bf16-mixed" else 4.0

    def params(self) -> float:
        h, t = float(self.m.hidden), float(self.p.tp)
        n = self.m.layers / self.p.pp * (12 * h * h / t + 7 * h / t + 6 * h) + (self.m.vocab + self.m.seq_len) * h
        return n + (2 * h + h * self.m.vocab if self.p.pp == 1 else 0.0)

    def calls(self):
        p, e = self.p, self.e
        n = round(self.params())
        flat = p.dp * math.ceil(n / p.dp) * e
        act = e * p.micro_batch * self.m.seq_len * self.m.hidden
        if p.dp > 1:
            yield from {0: [("dp", "all-reduce", 1, e * n)],
                        1: [("dp", "reduce-scatter", 1, flat), ("dp", "all-gather", 1, flat)],
                        2: [("dp", "reduce-scatter", p.micro_batches, flat), ("dp", "all-gather", 1, flat)],
                        3: [("dp", "all-gather", 2 * p.micro_batches, flat),
                            ("dp", "reduce-scatter", p.micro_batches, flat)]}[p.zero]
        if p.tp > 1:
            yield "tp", "all-reduce", p.micro_batches * (self.m.layers // p.pp) * (6 if p.recompute == "full" else 4), act
        if p.pp > 1:
            yield "pp", "send", p.micro_batches, act

    def group(self, dim: str) -> int:
        return {"dp": self.p.dp, "tp": self.p.tp, "pp": self.p.pp}[dim]

    def flops(self) -> float:
        b, s, h, t = self.p.micro_batch, self.m.seq_len, self.m.hidden, self.p.tp
        fwd = (24 * b * s * h * h + 4 * b * s * s * h) / t
        extra = {"none": 0.0, "selective": 4 * b * s * s * h / t, "full": fwd}[self.p.recompute]
        head = 6 * b * s * h * self.m.vocab if self.p.pp == 1 else 0.0
        return self.p.micro_batches * (self.m.layers / self.p.pp * (3 * fwd + extra) + head)


def communication(model: ModelSpec, plan: Plan) -> Traffic:
    cm = CostModel(model, plan)
    out = Traffic()
    for dim, name, count, nbytes in cm.calls():
        getattr(out, dim)[name] = count * nbytes * CostModel.RING[name](cm.group(dim))
    return out


def step_time(model: ModelSpec, plan: Plan, cluster: Cluster) -> StepTime:
    cm = CostModel(model, plan)
    if cluster.gpus != plan.dp * plan.tp * plan.pp:
        raise ValueError("the plan's GPUs are not the cluster's")
    flops = cm.flops()
    compute = flops / (cluster.peak_flops * cluster.mfu * (0.5 if plan.precision == "fp32" else 1.0))
    width = {"tp": plan.tp, "dp": plan.tp * plan.dp, "pp": plan.tp * plan.dp * plan.pp}
    comm = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    for dim, name, count, nbytes in cm.calls():
        n = cm.group(dim)
        if width[dim] <= cluster.gpus_per_node:
            bw, lat = cluster.intra_node_bandwidth, cluster.intra_node_latency
        else:
            bw, lat = cluster.inter_node_bandwidth, cluster.inter_node_latency
        comm[dim] += count * (nbytes * CostModel.RING[name](n) / bw + CostModel.HOPS[name](n) * lat)
    busy = compute + comm["tp"] + comm["pp"]
    idle_share = (plan.pp - 1) / (plan.micro_batches + plan.pp - 1)   # GPipe's bubble, of the whole step
    total_pipelined = busy / (1 - idle_share)
    exposed = max(0.0, comm["dp"] - compute)
    return StepTime(flops, compute, comm["dp"], comm["tp"], comm["pp"], total_pipelined - busy, exposed,
                    total_pipelined + exposed)


def choose_plan(model: ModelSpec, cluster: Cluster, global_batch_tokens: int) -> Plan:
    if global_batch_tokens % model.seq_len:
        raise ValueError("the global batch is not a whole number of sequences")
    sequences = global_batch_tokens // model.seq_len
    best = None
    for tp, pp, micro_batch in itertools.product((8, 4, 2, 1), range(model.layers, 0, -1), (1, 2, 4, 8)):
        if model.layers % pp or tp > cluster.gpus_per_node or model.heads % tp or cluster.gpus % (tp * pp):
            continue
        dp = cluster.gpus // (tp * pp)
        if sequences % (dp * micro_batch):
            continue
        for zero, schedule in itertools.product((3, 2, 1, 0), ("1f1b", "gpipe")):
            if zero >= 2 and pp > 1:
                continue
            # least memory first: when full recomputation does not fit, neither does keeping more
            for recompute in ("full", "selective", "none"):
                plan = Plan(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=micro_batch,
                            micro_batches=sequences // (dp * micro_batch), schedule=schedule,
                            precision="bf16-mixed", recompute=recompute)
                if training_memory(model, plan).total > cluster.memory_bytes:
                    break
                seconds = step_time(model, plan, cluster).total_s
                if best is None or seconds < best[0]:
                    best = (seconds, plan)
    if best is None:
        raise ValueError(f"no plan fits {cluster.memory_bytes / 1e9:.0f} GB per GPU")
    return best[1]
