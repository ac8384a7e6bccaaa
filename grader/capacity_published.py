"""Published training runs beside the kit's cost model (``ddp-grade plan --published``).

Each row is one figure a paper published (checked against the paper itself: source, table and row in
``source`` and ``row``), the model and plan that produced it as :mod:`grader.capacity` describes them, and
the path of the figure in ``ddp-grade plan --json``'s answer (``metric``). What the paper leaves unsaid
(micro-batch size, virtual stages) is the kit's reading, said in ``note``; the compute efficiency is
the cluster's, one per GPU kind (grader/capacity_plans.py), never chosen per row.

* Llama 3 405B, Table 4 of "The Llama 3 Herd of Models" (2024): three configurations, BF16 MFU.
* Megatron-LM 2021 (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM"), Table 1: ten GPT models, achieved teraFLOP/s per GPU.
* ZeRO (Rajbhandari et al. 2020), Figure 1: model states per GPU of a 7.5B model on 64 GPUs.
* Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), Table 2: the
  activations of one layer per technique, at each model of their Table 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction as F

from grader import capacity
from grader.capacity import ModelSpec, Plan
from grader.capacity_plans import GPU_KINDS, llama3_405b

LLAMA = "Llama 3, Table 4"
MEGATRON = "Megatron-LM 2021 (Narayanan et al.), Table 1"
ZERO = "ZeRO, Figure 1"
KORTHIKANTI = "Korthikanti et al. 2022, Table 2"


@dataclass(frozen=True)
class Row:
    source: str
    row: str               # which row or configuration of the source
    model: ModelSpec
    plan: Plan
    gpu: str               # a key of capacity_plans.GPU_KINDS
    metric: str            # dotted path into `ddp-grade plan --json`'s answer
    published: float       # in the metric's unit
    unit: str
    note: str = ""         # what this row alone needs said (READINGS has what a source's rows share)
    checks: dict = field(default_factory=dict)  # other published facts of the row: {"fits": bytes per GPU}


# --- Llama 3 405B, Table 4 ---------------------------------------------------------------------------------
# "GPUs TP CP PP DP Seq. Len. Batch size/DP Tokens/Batch TFLOPs/GPU BF16 MFU": 8,192 8 1 16 64 8,192 32 16M
# 430 43%; 16,384 8 1 16 128 8,192 16 16M 400 41%; 16,384 8 16 16 4 131,072 16 16M 380 38%. Section 3.3.2:
# FSDP shards optimizer states and gradients and keeps the parameters after forward (ZeRO 2); one layer
# less on the first and the last stage, whose first and last model chunks hold only the embedding and
# the head (so one layer per chunk: 16 x 8 chunks for 126 layers); interleaved schedule; no activation
# checkpointing at 8K tokens; K and V all-gathered for context parallelism.
LLAMA_LAYOUT = (0,) + (1,) * 126 + (0,)


def _llama(row: str, gpus: int, dp: int, cp: int, seq_len: int, sequences: int, mfu: float, note: str = "") -> Row:
    plan = Plan(dp=dp, tp=8, pp=16, zero=2, micro_batch=1, micro_batches=sequences, recompute="none", sp=True, cp=cp,
                vpp=8, stage_layers=LLAMA_LAYOUT, vocab_parallel=True, attention="flash")
    assert plan.world_size == gpus
    return Row(LLAMA, row, llama3_405b(seq_len), plan, "H100", "mfu", mfu, "MFU", note, {"fits": 80e9})


LLAMA_ROWS = [
    _llama("8,192 GPUs, TP 8, PP 16, DP 64, 8,192 tokens", 8192, 64, 1, 8192, 32, 0.43),
    _llama("16,384 GPUs, TP 8, PP 16, DP 128, 8,192 tokens", 16384, 128, 1, 8192, 16, 0.41),
    _llama("16,384 GPUs, TP 8, CP 16, PP 16, 131,072 tokens", 16384, 8, 16, 131072, 16, 0.38,
           "the table prints DP 4; its 16,384 GPUs and 16M tokens a batch need DP 8"),
]

# --- Megatron-LM 2021, Table 1 -------------------------------------------------------------------------------
# (parameters, heads, hidden, layers, TP, PP, GPUs, batch size, TFLOP/s per GPU); vocabulary 51,200 and
# sequences of 2,048 tokens for all (section 5.1). Section 5.1: the interleaved schedule with the
# scatter/gather optimization; equation (3) counts FLOPs with activation recomputation. The gradients are
# all-reduced after the last micro-batch's backward (Megatron-LM's train_step of 2021, DDP_impl 'local').
# Unpublished, the kit's reading: micro-batch 1 (as their Table 2's PTD-P rows), and the virtual stages
# (vpp) the kit's cost model finds fastest for the published TP, PP, DP and batch (tests check it).
MEGATRON_TABLE = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 1), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 1),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 1), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 1),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 3), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 5),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 5), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 6),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 3), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 2),
)


def megatron_plan(tp: int, pp: int, gpus: int, batch: int, vpp: int) -> Plan:
    dp = gpus // (tp * pp)
    return Plan(dp=dp, tp=tp, pp=pp, zero=0, micro_batch=1, micro_batches=batch // dp, recompute="full", vpp=vpp,
                vocab_parallel=tp > 1, scatter_gather=pp > 1, dp_overlap=False)


MEGATRON_ROWS = [
    Row(MEGATRON, f"{size}B: a {heads}, h {hidden}, L {layers}, TP {tp}, PP {pp}, {gpus:,} GPUs, batch {batch:,}"
        + (f" (vpp {vpp})" if vpp > 1 else ""), ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200,
                                                          seq_len=2048),
        megatron_plan(tp, pp, gpus, batch, vpp), "A100", "tflops_per_gpu", published, "TFLOP/s per GPU")
    for size, heads, hidden, layers, tp, pp, gpus, batch, published, vpp in MEGATRON_TABLE
]

# --- ZeRO, Figure 1 ------------------------------------------------------------------------------------------
# "7.5B parameters, 64 GPUs, K = 12": 120 GB per GPU, 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p).
# The model: 32 layers of hidden 4096 and a vocabulary sized so that it has 7,499,997,184 parameters.
ZERO_MODEL = ModelSpec(layers=32, hidden=4096, heads=32, vocab=127862, seq_len=2048)
ZERO_ROWS = [Row(ZERO, f"{label}, 64 GPUs", ZERO_MODEL, Plan(dp=64, zero=stage), "A100", "memory.model_states",
                 gb * 1e9, "bytes")
             for stage, label, gb in ((0, "baseline", 120.0), (1, "P_os", 31.4), (2, "P_os+g", 16.6), (3, "P_os+g+p", 1.9))]

# --- Korthikanti et al. 2022, Table 2 (with their Table 3's models) -------------------------------------------
# Activations per transformer layer, in bytes, 16-bit: no parallelism sbh(34 + 5as/h); tensor parallel
# sbh(10 + 24/t + 5as/(ht)); tensor + sequence parallel sbh(34/t + 5as/(ht)); tensor parallel + selective
# recomputation sbh(10 + 24/t); tensor + sequence parallel + selective sbh(34/t); full recomputation sbh(2).
# Table 3: 22B (64 heads, hidden 6144, micro-batch 4), 175B (96, 12288, 1), 530B (128, 20480, 1), 1T (160,
# 25600, 1); t = 8, s = 2048, vocabulary 51,200.
KORTHIKANTI_MODELS = {"22B": (64, 6144, 4), "175B": (96, 12288, 1), "530B": (128, 20480, 1), "1T": (160, 25600, 1)}
KORTHIKANTI_TECHNIQUES = {  # the table's row: (t, sp, recompute, bytes per s b h as a function of a, s, h, t)
    "no parallelism": (1, False, "none", lambda a, s, h, t: 34 + F(5 * a * s, h)),
    "tensor parallel": (8, False, "none", lambda a, s, h, t: 10 + F(24, t) + F(5 * a * s, h * t)),
    "tensor + sequence parallel": (8, True, "none", lambda a, s, h, t: F(34, t) + F(5 * a * s, h * t)),
    "tensor parallel + selective": (8, False, "selective", lambda a, s, h, t: 10 + F(24, t)),
    "tensor + sequence parallel + selective": (8, True, "selective", lambda a, s, h, t: F(34, t)),
    "full recomputation": (8, False, "full", lambda a, s, h, t: 2),
}


def _korthikanti(size: str, technique: str) -> Row:
    heads, hidden, b = KORTHIKANTI_MODELS[size]
    t, sp, recompute, formula = KORTHIKANTI_TECHNIQUES[technique]
    s = 2048
    model = ModelSpec(layers=1, hidden=hidden, heads=heads, vocab=51200, seq_len=s)
    plan = Plan(tp=t, micro_batch=b, recompute=recompute, sp=sp, vocab_parallel=sp)
    return Row(KORTHIKANTI, f"{technique}, {size} (a {heads}, h {hidden}, b {b})", model, plan, "A100",
               "memory.activations", float(s * b * hidden * formula(heads, s, hidden, t)), "bytes")


KORTHIKANTI_ROWS = [_korthikanti(size, technique) for size in KORTHIKANTI_MODELS for technique in KORTHIKANTI_TECHNIQUES]

ROWS = LLAMA_ROWS + MEGATRON_ROWS + ZERO_ROWS + KORTHIKANTI_ROWS
SOURCES = (LLAMA, MEGATRON, ZERO, KORTHIKANTI)
READINGS = {  # what the rows of a source share that the source leaves unsaid, and how the kit reads it
    LLAMA: "micro-batch 1 (batch size/DP micro-batches); sequence parallelism with TP, the embeddings and head split "
           "over TP and flash attention (unpublished, as Megatron-LM and torchtitan run TP)",
    MEGATRON: "micro-batch 1 (as their Table 2's PTD-P rows); the virtual stages (vpp) the kit finds fastest; full "
              "recomputation and FLOPs as their equation (3); the head untied (Megatron-LM ties it to the "
              "embedding: the FLOPs are the same)",
    ZERO: "a 32-layer model of hidden 4096 with 7,499,997,184 parameters; the figure's GB are 1e9 bytes, rounded "
          "to 0.1 GB",
    KORTHIKANTI: "one layer: the table's formula at each model of their Table 3 (t = 8, s = 2048)",
}


def cluster_of(row: Row) -> capacity.Cluster:
    kind = GPU_KINDS[row.gpu]
    return capacity.Cluster(**{**capacity.to_dict(kind), "gpus": row.plan.world_size})
