"""Plans under the kit's cost model (:mod:`grader.capacity`): the clusters, the scenarios, the two searches,
the two step times and what limits a plan.

* Two step times (a ``timer``): 42's (:func:`grader.capacity.step_time`, every FLOP at the cluster's one
  compute efficiency; what 41-43 grade and 43's search uses) and the kit's (:mod:`grader.capacity_speed`:
  each matmul from its shape, the work bound by memory, the cost of scale; ``ddp-grade plan`` and the
  kit's planner use it for the GPU kinds it knows).

* 43's search (``candidate_plans``, ``best_plan``): the GPT-style plans exercise 43 allows (tp 1-8 inside a
  node, pp a divisor of the layers, ZeRO 2 and 3 only without pipeline stages, bf16-mixed).
* The kit's planner (``planner_plans``, ``best_frontier``): what frontier runs use besides, sequence
  parallelism with every tensor-parallel plan, flash attention, ZeRO 1-3 with pipeline stages,
  interleaved virtual stages, stages that trim the first and last (Llama 3's), context parallelism for
  long sequences (K and V all-gathered or passed round a ring), experts over ranks, and the published plan of
  the scenario when there is one.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, replace
from typing import Callable

from grader import capacity, capacity_speed
from grader.capacity import Cluster, ModelSpec, Plan, PlanError, StepTime

# --- clusters ----------------------------------------------------------------------------------------------
#
# ``mfu`` is the compute efficiency 42's step time runs every FLOP at: 0.54, what the Llama 3 405B and
# Megatron-LM 2021 rows gave the one-efficiency model of 41-43 (0.5437 and 0.5422). The kit's own step time
# (grader/capacity_speed.py) does not read it: it times each matmul from its shape.

H100 = Cluster(gpus=64, gpus_per_node=8, peak_flops=989e12, mfu=0.54, memory_bytes=80e9,
               intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,   # NVLink 4, 400 Gb/s NIC per GPU
               intra_node_latency=5e-6, inter_node_latency=2e-5)
A100 = Cluster(gpus=64, gpus_per_node=8, peak_flops=312e12, mfu=0.54, memory_bytes=80e9,
               intra_node_bandwidth=300e9, inter_node_bandwidth=25e9,   # NVLink 3, 200 Gb/s HDR per GPU
               intra_node_latency=5e-6, inter_node_latency=2e-5)
GPU_KINDS = {"H100": H100, "A100": A100}


def on(cluster: Cluster, gpus: int) -> Cluster:
    return Cluster(**{**asdict(cluster), "gpus": gpus})


def gpu_kind(cluster: Cluster) -> str | None:
    """The GPU kind whose peak ``cluster`` has, or None."""
    return next((name for name, kind in GPU_KINDS.items() if kind.peak_flops == cluster.peak_flops), None)


Timer = Callable[[ModelSpec, Plan, Cluster], StepTime]


def kit_timer(kind: str) -> Timer:
    """The kit's step time on ``kind`` GPUs."""
    return functools.partial(_kit_step, kind=kind)


def _kit_step(model: ModelSpec, plan: Plan, cluster: Cluster, kind: str) -> StepTime:
    return capacity_speed.step_time(model, plan, cluster, kind)


def timer_for(cluster: Cluster, flat: bool = False) -> Timer:
    """The kit's step time for a GPU kind it knows, 42's when ``flat`` or for another cluster."""
    kind = gpu_kind(cluster)
    return capacity.step_time if flat or kind not in capacity_speed.DEVICES else kit_timer(kind)


# --- scenarios -------------------------------------------------------------------------------------------

GPT_8B = ModelSpec(layers=32, hidden=4096, heads=32, vocab=128256, seq_len=8192)
GPT_70B = ModelSpec(layers=80, hidden=8192, heads=64, vocab=128256, seq_len=8192)
GPT_405B = ModelSpec(layers=126, hidden=16384, heads=128, vocab=128256, seq_len=8192)
SCENARIOS = {  # 43's: a GPT-style model, its cluster, its global batch in tokens
    "8B on 64 GPUs": (GPT_8B, on(H100, 64), 4 * 2**20),
    "70B on 1,024 GPUs": (GPT_70B, on(H100, 1024), 4 * 2**20),
    "405B on 16,384 GPUs": (GPT_405B, on(H100, 16384), 16 * 2**20),
    # where a search goes wrong: the fastest plan has pipeline stages (without them the best is 1.18 x slower);
    "70B at 4K tokens on 64 GPUs": (replace(GPT_70B, seq_len=4096), on(H100, 64), 4 * 2**20),
    # nodes of 4 GPUs and 100 GB/s between them: tp 8 across two nodes would be fastest, and is not allowed;
    "70B on 1,024 GPUs of 4-GPU nodes": (GPT_70B, replace(on(H100, 1024), gpus_per_node=4, inter_node_bandwidth=100e9),
                                         2**20),
    # 52 heads (LLaMA 33B's width at 8K tokens): tp 8 would be fastest, and does not divide them.
    "33B on 1,024 GPUs": (ModelSpec(layers=60, hidden=6656, heads=52, vocab=128256, seq_len=8192), on(H100, 1024), 2**20),
}


def llama3_405b(seq_len: int = 8192) -> ModelSpec:
    """Llama 3 405B (Llama 3 paper, Table 3): grouped-query attention, SwiGLU, RMSNorm, RoPE, no biases."""
    return ModelSpec(layers=126, hidden=16384, heads=128, vocab=128256, seq_len=seq_len, kv_heads=8, ffn=53248,
                     mlp="swiglu", norm="rmsnorm", bias=False, positions="rope", dropout=False)


FRONTIER = {  # the kit's planner: a model, its cluster, its global batch, the plan it is known to have run
    "Llama 3 405B on 8,192 GPUs": (llama3_405b(), on(H100, 8192), 16 * 2**20),
    "Llama 3 405B on 16,384 GPUs": (llama3_405b(), on(H100, 16384), 16 * 2**20),
    "Llama 3 405B, 128K context, on 16,384 GPUs": (llama3_405b(131072), on(H100, 16384), 16 * 2**20),
}


# --- 43's search ---------------------------------------------------------------------------------------


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in order (a square root's worth of trials: any --layers answers at once)."""
    small = [k for k in range(1, int(n ** 0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


MICRO_BATCHES = (1, 2, 4, 8)
TENSOR_PARALLEL = (1, 2, 4, 8)


def sequences_of(model: ModelSpec, global_batch_tokens: int) -> int:
    if global_batch_tokens % model.seq_len:
        raise PlanError(f"global batch of {global_batch_tokens} tokens is not a whole number of "
                        f"{model.seq_len}-token sequences")
    return global_batch_tokens // model.seq_len


def exercise_refusal(model: ModelSpec, plan: Plan) -> str | None:
    """Why 41-43 do not take ``plan`` for ``model`` although the kit's model does, or None."""
    if not capacity.exercise_plan(model, plan):
        return "41-43 model the GPT-style transformer and its plans only (dp, tp, pp, zero, micro-batches, " \
               "schedule, precision, recompute)"
    if plan.zero >= 2 and plan.pp > 1:
        return f"41-43 refuse ZeRO stage {plan.zero} with {plan.pp} pipeline stages (the kit's planner takes it)"
    if plan.precision == "fp8-mixed":
        return "41-43 model bf16-mixed and fp32 only (float8 is the kit's model's: ddp-grade plan --precision fp8-mixed)"
    return None


def candidate_plans(model: ModelSpec, cluster: Cluster, global_batch_tokens: int):
    """Every plan 43 may choose from: bf16-mixed, tp in 1, 2, 4, 8 inside a node, pp a divisor of
    the layers, dp the rest of the GPUs, ZeRO 0-3, both schedules, every recomputation, micro-batch
    sizes 1, 2, 4, 8, and as many micro-batches as the global batch then needs."""
    sequences = sequences_of(model, global_batch_tokens)
    for tp, pp in itertools.product(TENSOR_PARALLEL, divisors(model.layers)):
        if tp > cluster.gpus_per_node or model.heads % tp or cluster.gpus % (tp * pp):
            continue
        dp = cluster.gpus // (tp * pp)
        for b in MICRO_BATCHES:
            if sequences % (dp * b):
                continue
            m = sequences // (dp * b)
            for zero, schedule, recompute in itertools.product((0, 1, 2, 3), capacity.SCHEDULES, capacity.RECOMPUTES):
                if zero >= 2 and pp > 1:
                    continue
                yield Plan(dp, tp, pp, zero, b, m, schedule, "bf16-mixed", recompute)


def fits(model: ModelSpec, plan: Plan, cluster: Cluster) -> bool:
    return capacity.training_memory(model, plan).total <= cluster.memory_bytes


def fastest(model: ModelSpec, cluster: Cluster, plans, timer: Timer = capacity.step_time) -> Plan | None:
    """The fastest of ``plans`` that fits (ties: fewer bytes, then the first found), timed by ``timer``."""
    best, key = None, None
    for plan in plans:
        memory = capacity.training_memory(model, plan).total
        if memory > cluster.memory_bytes:
            continue
        candidate = (timer(model, plan, cluster).total_s, memory)
        if key is None or candidate < key:
            best, key = plan, candidate
    return best


@functools.lru_cache(maxsize=64)  # the arguments are frozen dataclasses: 43's report and checks ask twice
def best_plan(model: ModelSpec, cluster: Cluster, global_batch_tokens: int) -> Plan | None:
    """43's answer: the fastest plan of candidate_plans that fits, by exhaustive search under 42's step time."""
    return fastest(model, cluster, candidate_plans(model, cluster, global_batch_tokens))


# --- the kit's planner -------------------------------------------------------------------------------------


def layouts(model: ModelSpec, pp: int) -> list[tuple[int, tuple]]:
    """(vpp, stage_layers) the planner tries for ``pp`` ranks: even stages of 1, 2, 4 or 8 chunks a rank, and
    trimmed ones (the first and last virtual stage one layer short, for the embeddings and the head)."""
    out = []
    for vpp in (1, 2, 4, 8):
        if vpp > 1 and pp == 1:
            continue
        chunks = pp * vpp
        if model.layers % chunks == 0:
            out.append((vpp, ()))
        if pp > 1 and (model.layers + 2) % chunks == 0 and (model.layers + 2) // chunks >= 1:
            size = (model.layers + 2) // chunks
            out.append((vpp, (size - 1,) + (size,) * (chunks - 2) + (size - 1,)))
    return out


def planner_plans(model: ModelSpec, cluster: Cluster, global_batch_tokens: int):
    """The kit's planner's plans: bf16-mixed, flash attention, sequence parallelism (and vocabulary-parallel
    embeddings and head) whenever tp > 1, tp a power of two inside a node, pp with the layouts above, cp up
    to 16 for sequences of 32K tokens or more, ZeRO 1-3, 1F1B, no or full recomputation, micro-batches of 1,
    2 or 4 sequences, experts over ep ranks where the model has them."""
    sequences = sequences_of(model, global_batch_tokens)
    contexts = [c for c in (1, 2, 4, 8, 16) if c == 1 or model.seq_len >= 32768 and model.seq_len % c == 0]
    for tp, cp, pp in itertools.product(TENSOR_PARALLEL, contexts, divisors(cluster.gpus)):
        if tp > cluster.gpus_per_node or cluster.gpus % (tp * pp * cp) or pp > model.layers:
            continue
        dp = cluster.gpus // (tp * pp * cp)
        eps = [e for e in divisors(model.experts) if dp % e == 0] if model.experts else [1]
        for (vpp, stage_layers), b in itertools.product(layouts(model, pp), (1, 2, 4)):
            if sequences % (dp * b):
                continue
            m = sequences // (dp * b)
            comms = ("all-gather", "ring") if cp > 1 else ("all-gather",)
            for zero, recompute, ep, comm in itertools.product((1, 2, 3), ("none", "full"), eps, comms):
                plan = Plan(dp, tp, pp, zero, b, m, "1f1b", "bf16-mixed", recompute, sp=tp > 1, cp=cp, vpp=vpp,
                            stage_layers=stage_layers, vocab_parallel=tp > 1, attention="flash", ep=ep, cp_comm=comm)
                try:
                    capacity.validate(model, plan, cluster.gpus)
                except PlanError:
                    continue
                yield plan


@functools.lru_cache(maxsize=16)
def best_frontier(model: ModelSpec, cluster: Cluster, global_batch_tokens: int, known: Plan | None = None,
                  flat: bool = False) -> Plan | None:
    """The kit's planner's answer: the fastest plan of planner_plans, or ``known`` (a published plan) if faster,
    under the kit's step time (42's when ``flat``)."""
    plans = itertools.chain(planner_plans(model, cluster, global_batch_tokens), [known] if known else [])
    return fastest(model, cluster, plans, timer_for(cluster, flat))


# --- throughput and what limits a plan -------------------------------------------------------------------


def model_flops(model: ModelSpec, plan: Plan) -> int:
    """FLOPs of one step over every GPU as the model counts them (MFU's): 3 x each forward, nothing
    recomputed, QK^T and times V over the whole sequence, experts at capacity factor 1, the head once."""
    whole = Plan(micro_batch=plan.micro_batch, micro_batches=plan.micro_batches)
    per = sum(capacity.layer_flops(model, whole, i) for i in range(model.layers)) + capacity.head_flops(model, whole)
    return 3 * per * plan.dp * plan.micro_batches


def hardware_flops(model: ModelSpec, plan: Plan) -> int:
    """FLOPs of one step over every GPU with what the plan recomputes (Megatron-LM 2021's count, F)."""
    whole = Plan(micro_batch=plan.micro_batch, micro_batches=plan.micro_batches, recompute=plan.recompute,
                 attention=plan.attention)
    per = sum(capacity.layer_step_flops(model, whole, i) for i in range(model.layers)) \
        + 3 * capacity.head_flops(model, whole)
    return per * plan.dp * plan.micro_batches


def utilisation(model: ModelSpec, plan: Plan, cluster: Cluster, time: StepTime | None = None) -> dict:
    """The step (42's time unless ``time`` is given) as throughput: MFU (model FLOPs over the GPUs' dense bf16
    peak), TFLOP/s per GPU counted with recomputation (Megatron-LM 2021's), tokens per second per GPU."""
    time = time or capacity.step_time(model, plan, cluster)
    gpus, tokens = plan.world_size, plan.dp * plan.micro_batches * plan.micro_batch * model.seq_len
    return {"mfu": model_flops(model, plan) / (time.total_s * gpus * cluster.peak_flops),
            "tflops_per_gpu": hardware_flops(model, plan) / (time.total_s * gpus) / 1e12,
            "tokens_per_s_per_gpu": tokens / time.total_s / gpus}


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def limits(model: ModelSpec, plan: Plan, cluster: Cluster, timer: Timer = capacity.step_time) -> list[str]:
    """What holds a plan back, in words: memory, the bubble, communication on a slow link, recomputation."""
    memory = capacity.training_memory(model, plan)
    time = timer(model, plan, cluster)
    said = []
    if memory.total > cluster.memory_bytes:
        said.append(f"memory: {memory.total / 1e9:.1f} GB does not fit in {cluster.memory_bytes / 1e9:.0f} GB")
    elif memory.total > 0.9 * cluster.memory_bytes:
        said.append(f"memory: {memory.total / 1e9:.1f} GB of {cluster.memory_bytes / 1e9:.0f} GB")
    share = _share(time.bubble_s, time.total_s)
    if share >= 0.05:
        layers = [sum(len(c) for c in capacity.chunk_layers(model, plan, r)) for r in range(plan.pp)]
        uneven = f"; rank 0 holds {layers[0]} layers, the busiest {max(layers)}" if max(layers) > layers[0] else ""
        chunks = f" x {plan.vpp} virtual" if plan.vpp > 1 else ""
        said.append(f"bubble: {share:.0%} of the step idle ({plan.pp}{chunks} stages, "
                    f"{plan.micro_batches} micro-batches{uneven})")
    for dimension, seconds in (("tp", time.tp_s), ("cp", time.cp_s), ("ep", time.ep_s), ("pp", time.pp_s),
                               ("dp", time.exposed_dp_s)):
        if _share(seconds, time.total_s) >= 0.05:
            fast = capacity.link(cluster, plan, dimension)[0] == cluster.intra_node_bandwidth
            where = "inside a node" if fast or cluster.inter_node_bandwidth == cluster.intra_node_bandwidth \
                else "across nodes"
            exposed = " not hidden by compute" if dimension == "dp" else ""
            said.append(f"{dimension} communication {where}{exposed}: {_share(seconds, time.total_s):.0%} of the step")
    if plan.recompute != "none":
        more = capacity.flops(model, plan) / capacity.flops(model, replace(plan, recompute="none")) - 1
        said.append(f"recomputation ({plan.recompute}): {more:.0%} more compute")
    return said or ["compute"]


TERMS = (("compute_s", "compute"), ("bubble_s", "the bubble"), ("tp_s", "tp communication"),
         ("cp_s", "cp communication"), ("ep_s", "ep communication"), ("pp_s", "pp communication"),
         ("exposed_dp_s", "dp communication not hidden"))


def why_differ(model: ModelSpec, cluster: Cluster, mine: Plan, theirs: Plan, who: str = "the published plan",
               timer: Timer = capacity.step_time) -> str:
    """Where the step times of two plans of one model and cluster part, in words (the largest terms first)."""
    a, b = timer(model, mine, cluster), timer(model, theirs, cluster)
    if mine == theirs:
        return f"the search picks {who}"
    deltas = sorted(((getattr(b, field) - getattr(a, field), what) for field, what in TERMS), key=lambda d: -abs(d[0]))
    parts = [f"{what} {'+' if d > 0 else '-'}{abs(d) / a.total_s:.0%}" for d, what in deltas if abs(d) >= 0.01 * a.total_s]
    ratio = b.total_s / a.total_s
    memory = (capacity.training_memory(model, mine).total / 1e9, capacity.training_memory(model, theirs).total / 1e9)
    verdict = f"{who} takes {ratio:.2f} x the pick's step" if ratio >= 1 else \
        f"{who} is {1 / ratio:.2f} x faster than the pick"
    return (f"{verdict} ({', '.join(parts) or 'the same terms'}, of the pick's step); "
            f"{memory[1]:.1f} GB per GPU against {memory[0]:.1f} GB")
