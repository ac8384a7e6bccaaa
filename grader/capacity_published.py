"""Published training runs beside the kit's cost model (``ddp-grade plan --published``): the runs it was fitted
on, formulas' figures, and runs held out, three groups kept apart.

* ``FIT_ROWS``: the measured runs the kit's two fitted constants (capacity_speed.K0 and LINK_EFFICIENCY)
  were fitted to, by ``fit`` (nothing else reads them to set a constant);
* ``FORMULA_ROWS``: figures that are a formula's, not a measurement's, where the kit must agree exactly:
  the ZeRO paper's model states (analytic, no GPU) and Korthikanti et al.'s activations per layer;
* ``HELD_OUT_ROWS``: measured runs the constants never saw, the model's check (``rms``).

Each row is one figure (checked against its source: ``source`` names the paper or table and its version,
``row`` the configuration), the model and plan that produced it as :mod:`grader.capacity` describes them,
and the path of the figure in ``ddp-grade plan --json``'s answer (``metric``). What a source leaves unsaid is
the kit's reading, said in ``note`` (one row) or READINGS (a source's rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction as F

from grader import capacity, capacity_speed
from grader.capacity import ModelSpec, Plan
from grader.capacity_plans import GPU_KINDS, hardware_flops, llama3_405b, model_flops

LLAMA = "Llama 3 (arXiv 2407.21783v3), Table 4"
MEGATRON = "Megatron-LM 2021 (Narayanan et al.), Table 1"
ZERO = "ZeRO (Rajbhandari et al. 2020), Figure 1"
KORTHIKANTI = "Korthikanti et al. 2022, Table 2"
KORTHIKANTI_MFU = "Korthikanti et al. 2022, their Table 3 models' MFU (Megatron-LM's README)"
MPT = "MosaicML llm-foundry, MPT training benchmarks (2023)"
NEMO = "NVIDIA NeMo 24.07 performance summary, DGX-H100, FP8"
MT_NLG = "MT-NLG 530B (Smith et al., arXiv 2201.11990), section 2.4"


@dataclass(frozen=True)
class Row:
    source: str
    row: str               # which row or configuration of the source
    model: ModelSpec
    plan: Plan
    gpu: str | None        # a key of capacity_plans.GPU_KINDS; None: a formula's figure, no GPU
    metric: str            # dotted path into `ddp-grade plan --json`'s answer
    published: float       # in the metric's unit
    unit: str
    group: str             # "fit", "formula" or "held-out"
    note: str = ""         # what this row alone needs said (READINGS has what a source's rows share)
    checks: dict = field(default_factory=dict)  # other published facts of the row: {"fits": bytes per GPU}


# --- Llama 3 405B, Table 4 (fit) -----------------------------------------------------------------------------
# "GPUs TP CP PP DP Seq. Len. Batch size/DP Tokens/Batch TFLOPs/GPU BF16 MFU": 8,192 8 1 16 64 8,192 32 16M
# 430 43%; 16,384 8 1 16 128 8,192 16 16M 400 41%; 16,384 8 16 16 8 131,072 16 16M 380 38% (arXiv v3; v1 and
# v2 print DP 4 in the last row, which its 16,384 GPUs and 16M tokens rule out). Section 3.3.2: FSDP shards
# optimizer states and gradients and keeps the parameters after forward (ZeRO 2); gradients accumulated over
# micro-batches and reduce-scattered over data-parallel ranks in FP32; one layer less on the first and the
# last stage, whose first and last model chunks hold only the embedding and the head (so one layer per chunk:
# 16 x 8 chunks for 126 layers); interleaved schedule; no activation checkpointing at 8K tokens; K and V
# all-gathered for context parallelism.
LLAMA_LAYOUT = (0,) + (1,) * 126 + (0,)


def _llama(row: str, gpus: int, dp: int, cp: int, seq_len: int, sequences: int, mfu: float, note: str = "") -> Row:
    plan = Plan(dp=dp, tp=8, pp=16, zero=2, micro_batch=1, micro_batches=sequences, recompute="none", sp=True, cp=cp,
                vpp=8, stage_layers=LLAMA_LAYOUT, vocab_parallel=True, attention="flash", grad_fp32=True)
    assert plan.world_size == gpus
    return Row(LLAMA, row, llama3_405b(seq_len), plan, "H100", "mfu", mfu, "MFU", "fit", note, {"fits": 80e9})


LLAMA_ROWS = [
    _llama("8,192 GPUs, TP 8, PP 16, DP 64, 8,192 tokens", 8192, 64, 1, 8192, 32, 0.43),
    _llama("16,384 GPUs, TP 8, PP 16, DP 128, 8,192 tokens", 16384, 128, 1, 8192, 16, 0.41),
    _llama("16,384 GPUs, TP 8, CP 16, PP 16, DP 8, 131,072 tokens", 16384, 8, 16, 131072, 16, 0.38,
           "arXiv v3 prints DP 8; v1 and v2 print DP 4, which 16,384 GPUs and 16M tokens a batch rule out"),
]

# --- Megatron-LM 2021, Table 1 (fit: every other row from the first; held out: the rest) ---------------------
# (parameters, heads, hidden, layers, TP, PP, GPUs, batch size, TFLOP/s per GPU); vocabulary 51,200 and
# sequences of 2,048 tokens for all (section 5.1); FLOPs with activation recomputation (equation 3). What the
# table leaves unsaid is in the scripts the paper's authors published for it (NVIDIA/Megatron-LM,
# examples/sc21/run_table_1.sh, 2021-08; CONFIG.sh: fp16, full recomputation "uniform"): the micro-batch
# size (MBS), the layers per virtual stage (vpp = layers / PP / that; 1 without the option) and the data-
# parallel implementation: torch's DDP (gradients all-reduced during backward) without pipeline stages,
# Megatron's "local" one (after the last micro-batch's backward) with them. Scatter/gather is on (section
# 4.1); tensor-parallel communication all waits (the asynchronous kind came in 2022).
MEGATRON_TABLE = (  # ..., published, MBS, vpp
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
)


def megatron_plan(tp: int, pp: int, gpus: int, batch: int, mbs: int, vpp: int) -> Plan:
    dp = gpus // (tp * pp)
    return Plan(dp=dp, tp=tp, pp=pp, zero=0, micro_batch=mbs, micro_batches=batch // (dp * mbs), recompute="full",
                vpp=vpp, vocab_parallel=tp > 1, scatter_gather=pp > 1, dp_overlap=pp == 1, tp_overlap=False)


MEGATRON_ROWS = [
    Row(MEGATRON, f"{size}B: a {heads}, h {hidden}, L {layers}, TP {tp}, PP {pp}, {gpus:,} GPUs, batch {batch:,}, "
        f"MBS {mbs}" + (f", vpp {vpp}" if vpp > 1 else ""),
        ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq_len=2048),
        megatron_plan(tp, pp, gpus, batch, mbs, vpp), "A100", "tflops_per_gpu", published, "TFLOP/s per GPU",
        "fit" if i % 2 == 0 else "held-out")
    for i, (size, heads, hidden, layers, tp, pp, gpus, batch, published, mbs, vpp) in enumerate(MEGATRON_TABLE)
]

# --- ZeRO, Figure 1 (formula) --------------------------------------------------------------------------------
# "7.5B parameters, 64 GPUs, K = 12": 120 GB per GPU, 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p): the
# paper's equation, (2 + 2 + K) Psi over the stages' sharding, not a measurement (the paper ran V100s).
# The model: 32 layers of hidden 4096 and a vocabulary sized so that it has 7,499,997,184 parameters.
ZERO_MODEL = ModelSpec(layers=32, hidden=4096, heads=32, vocab=127862, seq_len=2048)
ZERO_ROWS = [Row(ZERO, f"{label}, 64 GPUs", ZERO_MODEL, Plan(dp=64, zero=stage), None, "memory.model_states",
                 gb * 1e9, "bytes", "formula")
             for stage, label, gb in ((0, "baseline", 120.0), (1, "P_os", 31.4), (2, "P_os+g", 16.6), (3, "P_os+g+p", 1.9))]

# --- Korthikanti et al. 2022, Table 2 (formula), with their Table 3's models ---------------------------------
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
    return Row(KORTHIKANTI, f"{technique}, {size} (a {heads}, h {hidden}, b {b})", model, plan, None,
               "memory.activations", float(s * b * hidden * formula(heads, s, hidden, t)), "bytes", "formula")


KORTHIKANTI_ROWS = [_korthikanti(size, technique) for size in KORTHIKANTI_MODELS for technique in KORTHIKANTI_TECHNIQUES]

# --- Korthikanti et al. 2022, measured (held out) ---------------------------------------------------------------
# NVIDIA/Megatron-LM's README (2022-): "model (MFU) and hardware (HFU) FLOPs utilization for select
# configurations up to 1T parameters (see our paper) ... measured using a data parallel size of one": 22B
# 41.5 %, 175B 51.4 %, 530B 56.0 %, 1T 56.3 % MFU, on A100s, with sequence parallelism and selective
# recomputation. The configurations, the paper's Table 3: layers 48, 96, 105, 128; TP 8; PP 1, 8, 35, 64;
# 8, 64, 280, 512 GPUs; batch 4, 64, 280, 512; micro-batch 4, 1, 1, 1.
KORTHIKANTI_RUNS = (("22B", 48, 1, 4, 0.415), ("175B", 96, 8, 64, 0.514), ("530B", 105, 35, 280, 0.560),
                    ("1T", 128, 64, 512, 0.563))


def _korthikanti_run(size: str, layers: int, pp: int, batch: int, mfu: float) -> Row:
    heads, hidden, b = KORTHIKANTI_MODELS[size]
    plan = Plan(tp=8, pp=pp, micro_batch=b, micro_batches=batch // b, recompute="selective", sp=True,
                vocab_parallel=True)
    return Row(KORTHIKANTI_MFU, f"{size}: L {layers}, TP 8, PP {pp}, {8 * pp} GPUs, batch {batch}", ModelSpec(
        layers=layers, hidden=hidden, heads=heads, vocab=51200, seq_len=2048), plan, "A100", "mfu", mfu, "MFU",
        "held-out")


KORTHIKANTI_MFU_ROWS = [_korthikanti_run(*run) for run in KORTHIKANTI_RUNS]

# --- MPT, llm-foundry's benchmarks (held out) ------------------------------------------------------------------
# mosaicml/llm-foundry, scripts/train/benchmarking/README.md ("MPT Training Benchmarks", 2023): the tables "A100
# 80GB with 1600 Gbps node-node interconnect (RoCE)" and "H100 80GB BF16", the rows of 2,048-token sequences;
# FSDP FULL_SHARD (ZeRO 3), bf16, activation checkpointing as the row says; MFU counted as the kit counts it
# (6 N + attention over the whole sequence, the README's formula). The models (the yamls beside it): vocabulary
# 50,368, expansion ratio 4, GELU, no biases, no dropout; d_model, heads and layers below; the position
# embedding learned (the table's parameter counts grow with the sequence by seq x d_model).
MPT_MODELS = {"350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24), "3b": (2560, 20, 32),
              "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
MPT_RUNS = (  # size, GPUs, GPU, micro-batch, accumulation, activation checkpointing, MFU
    ("350m", 8, "A100", 32, 2, False, 0.5162), ("760m", 8, "A100", 24, 2, False, 0.5685),
    ("1b", 8, "A100", 14, 4, False, 0.5986), ("3b", 8, "A100", 10, 2, False, 0.6211),
    ("7b", 8, "A100", 6, 2, False, 0.6423), ("13b", 8, "A100", 2, 3, False, 0.5957),
    ("30b", 8, "A100", 3, 21, True, 0.553), ("70b", 64, "A100", 8, 4, True, 0.5333),
    ("760m", 16, "H100", 24, 1, False, 0.3789), ("1b", 16, "H100", 20, 1, False, 0.4236),
    ("3b", 16, "H100", 10, 3, False, 0.4373), ("7b", 8, "H100", 6, 1, False, 0.4644),
    ("13b", 8, "H100", 2, 1, False, 0.3979), ("30b", 16, "H100", 10, 3, True, 0.4307),
    ("70b", 64, "H100", 8, 4, True, 0.4257),
)


def _mpt(size: str, gpus: int, gpu: str, mbs: int, accumulation: int, checkpointing: bool, mfu: float) -> Row:
    hidden, heads, layers = MPT_MODELS[size]
    model = ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=50368, seq_len=2048, bias=False, dropout=False)
    plan = Plan(dp=gpus, zero=3, micro_batch=mbs, micro_batches=accumulation, attention="flash",
                recompute="full" if checkpointing else "none")
    return Row(MPT, f"MPT-{size}, {gpus} {gpu}s, micro-batch {mbs} x {accumulation}"
               + (", checkpointing" if checkpointing else ""), model, plan, gpu, "mfu", mfu, "MFU", "held-out")


MPT_ROWS = [_mpt(*run) for run in MPT_RUNS]

# --- NeMo 24.07, FP8 on DGX-H100 (held out) ---------------------------------------------------------------------
# NVIDIA/NeMo, docs/source/performance/performance_summary.md at 8e3d65d ("24.07 perf numbers", 2024-09):
# "pre-training performance ... at FP8 precision", Tokens / sec / GPU. The models: NeMo's GPTConfig5B, 20B and
# 175B (nemo/collections/llm/gpt/model/base.py: LayerNorm, GELU, learned positions, biases, dropout; the
# GPT-2 vocabulary padded to 50,304) and Llama2Config7B, 13B, 70B, Llama3Config8B, 70B (llama.py: RMSNorm,
# SwiGLU, RoPE, no biases or dropout; vocabularies 32,000 and 128,256; 8 KV heads for Llama 2 70B and Llama 3).
NEMO_GPT = dict(vocab=50304, seq_len=2048)
NEMO_LLAMA2 = dict(vocab=32000, seq_len=4096, mlp="swiglu", norm="rmsnorm", bias=False, positions="rope",
                   dropout=False)
NEMO_LLAMA3 = dict(NEMO_LLAMA2, vocab=128256, seq_len=8192, kv_heads=8)
NEMO_RUNS = (  # name, model, GPUs, global batch, micro-batch, TP, PP, CP, VP, tokens/s/GPU
    ("GPT3-5B", ModelSpec(layers=24, hidden=4096, heads=32, ffn=16384, **NEMO_GPT), 64, 2048, 4, 1, 1, 1, 1, 23406),
    ("GPT3-20B", ModelSpec(layers=44, hidden=6144, heads=48, ffn=24576, **NEMO_GPT), 64, 256, 2, 2, 1, 1, 1, 5851),
    ("GPT3-175B", ModelSpec(layers=96, hidden=12288, heads=96, ffn=49152, **NEMO_GPT), 128, 256, 1, 4, 8, 1, 6, 716),
    ("GPT3-175B", ModelSpec(layers=96, hidden=12288, heads=96, ffn=49152, **NEMO_GPT), 512, 2048, 2, 4, 8, 1, 6, 825),
    ("LLAMA2-7B", ModelSpec(layers=32, hidden=4096, heads=32, ffn=11008, **NEMO_LLAMA2), 8, 128, 1, 1, 1, 1, 1, 16934),
    ("LLAMA2-13B", ModelSpec(layers=40, hidden=5120, heads=40, ffn=13824, **NEMO_LLAMA2), 16, 128, 1, 1, 4, 1, 10,
     8715),
    ("LLAMA2-70B", ModelSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, **NEMO_LLAMA2), 64, 128, 1, 4,
     4, 1, 20, 1728),
    ("LLAMA3-8B", ModelSpec(layers=32, hidden=4096, heads=32, ffn=14336, **NEMO_LLAMA3), 8, 128, 1, 1, 1, 2, 1, 12273),
    ("LLAMA3-70B", ModelSpec(layers=80, hidden=8192, heads=64, ffn=28672, **NEMO_LLAMA3), 64, 128, 1, 4, 4, 2, 5, 1524),
)


def _nemo(name: str, model: ModelSpec, gpus: int, batch: int, mbs: int, tp: int, pp: int, cp: int, vp: int,
          tokens: float) -> Row:
    dp = gpus // (tp * pp * cp)
    plan = Plan(dp=dp, tp=tp, pp=pp, cp=cp, zero=1, micro_batch=mbs, micro_batches=batch // (dp * mbs), vpp=vp,
                sp=tp > 1, vocab_parallel=tp > 1, attention="flash", precision="fp8-mixed", tp_comm_overlap=tp > 1,
                pp_overlap=vp > 1)
    return Row(NEMO, f"{name}, {gpus} GPUs, TP {tp}, PP {pp}, CP {cp}, VP {vp}, batch {batch}", model, plan, "H100",
               "tokens_per_s_per_gpu", tokens, "tokens/s per GPU", "held-out")


NEMO_ROWS = [_nemo(*run) for run in NEMO_RUNS]

# --- MT-NLG 530B, section 2.4 (held out) ------------------------------------------------------------------------
# Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv 2201.11990), section 2.4:
# global batch 1,920 sequences of 2,048 tokens on 280, 350 and 420 DGX A100 nodes, 60.1, 50.2 and 44.4 s an
# iteration, "126, 121, and 113 teraFLOP/s per GPU"; 8-way tensor slicing inside a node, 35-way pipeline
# parallelism across nodes (so DP 8, 10, 12); the model as Megatron-LM 2021's 530B (105 layers, hidden 20,480,
# 128 heads). Their TFLOP/s are Megatron-LM's equation (3), with the recomputed forward: 126 is 1920 sequences'
# FLOPs over 60.1 s and 2,240 GPUs.
MT_NLG_RUNS = ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113))


def _mt_nlg(nodes: int, seconds: float, tflops: float) -> Row:
    dp = nodes * 8 // (8 * 35)
    plan = Plan(dp=dp, tp=8, pp=35, zero=1, micro_batch=1, micro_batches=1920 // dp, recompute="full",
                vocab_parallel=True, dp_overlap=False, tp_overlap=False)
    model = ModelSpec(layers=105, hidden=20480, heads=128, vocab=51200, seq_len=2048)
    return Row(MT_NLG, f"{nodes} nodes ({nodes * 8:,} GPUs), TP 8, PP 35, DP {dp}, batch 1,920, {seconds:g} s an "
               f"iteration", model, plan, "A100", "tflops_per_gpu", tflops, "TFLOP/s per GPU", "held-out")


MT_NLG_ROWS = [_mt_nlg(*run) for run in MT_NLG_RUNS]

FIT_ROWS = LLAMA_ROWS + [row for row in MEGATRON_ROWS if row.group == "fit"]
FORMULA_ROWS = ZERO_ROWS + KORTHIKANTI_ROWS
HELD_OUT_ROWS = [row for row in MEGATRON_ROWS if row.group == "held-out"] + KORTHIKANTI_MFU_ROWS + MPT_ROWS + NEMO_ROWS \
    + MT_NLG_ROWS
ROWS = FIT_ROWS + FORMULA_ROWS + HELD_OUT_ROWS
GROUPS = {"fit": "fitted on", "formula": "a formula's figure", "held-out": "held out"}
SOURCES = (LLAMA, MEGATRON, ZERO, KORTHIKANTI, KORTHIKANTI_MFU, MPT, NEMO, MT_NLG)
READINGS = {  # what the rows of a source share that the source leaves unsaid, and how the kit reads it
    LLAMA: "micro-batch 1 (batch size/DP micro-batches); sequence parallelism with TP, the embeddings and head split "
           "over TP and flash attention (unpublished, as Megatron-LM and torchtitan run TP); gradients reduced in "
           "FP32 (section 3.3.2)",
    MEGATRON: "the micro-batch, virtual stages and data-parallel implementation of the authors' scripts "
              "(examples/sc21/run_table_1.sh); full recomputation and FLOPs as their equation (3); the head untied "
              "(Megatron-LM ties it to the embedding: the FLOPs are the same); tensor-parallel traffic not overlapped",
    ZERO: "analytic (the paper's equation, no GPU: it ran V100s): a 32-layer model of hidden 4096 with "
          "7,499,997,184 parameters; the figure's GB are 1e9 bytes, rounded to 0.1 GB",
    KORTHIKANTI: "one layer: the table's formula at each model of their Table 3 (t = 8, s = 2048); no GPU",
    KORTHIKANTI_MFU: "DP 1 as the README says; their Table 3's sizes; no interleaving (none is given)",
    MPT: "FSDP as ZeRO 3 with traffic behind compute; flash attention (triton's); the micro-batch, accumulation "
         "and 2,048-token sequences of each row; their MFU is the kit's (each row's Model TFLOP over its MFU is "
         "the dense bf16 peak, 989 TFLOP/s on the H100, 312 on the A100; FLOPs 6 N plus attention over the whole "
         "square); the tables predate torch 2.0 (the README's TODO): the H100 rows ran its first software, "
         "slower than the kernels the kit assumes",
    MT_NLG: "DeepSpeed's pipeline engine with Megatron-LM's layers: 1F1B without interleaving or scatter/gather, "
            "micro-batch 1, full recomputation (their TFLOP/s count it), ZeRO 1, gradients reduced after the last "
            "micro-batch, tensor-parallel traffic not overlapped (2021); the vocabulary padded as Megatron-LM pads "
            "GPT-2's for TP 8 (51,200)",
    NEMO: "ZeRO 1 (the distributed optimizer), sequence parallelism with TP, flash attention, no recomputation; "
          "the layers' linear maps in float8, the rest in bf16; the overlaps NeMo's performance recipes turn on "
          "(NeMo-Framework-Launcher conf/training/gpt3/175b_fp8_performance.yaml: ub_tp_comm_overlap, "
          "overlap_p2p_comm): every tensor-parallel collective under the products with TP, pipeline sends "
          "beside the compute with virtual stages",
}


def cluster_of(row: Row) -> capacity.Cluster:
    """The cluster a row ran on (a formula's rows: an A100's, whose memory they never reach)."""
    kind = GPU_KINDS[row.gpu or "A100"]
    return capacity.Cluster(**{**capacity.to_dict(kind), "gpus": row.plan.world_size})


# --- the fit ------------------------------------------------------------------------------------------------


def measured_value(row: Row, constants: capacity_speed.Constants = capacity_speed.FITTED) -> float:
    """The kit's figure for a measured row (MFU, TFLOP/s or tokens/s per GPU) with ``constants``."""
    cluster = cluster_of(row)
    time = capacity_speed.step_time(row.model, row.plan, cluster, row.gpu, constants).total_s
    gpus = row.plan.world_size
    if row.metric == "mfu":
        return model_flops(row.model, row.plan) / (time * gpus * cluster.peak_flops)
    if row.metric == "tflops_per_gpu":
        return hardware_flops(row.model, row.plan) / (time * gpus) / 1e12
    tokens = row.plan.dp * row.plan.micro_batches * row.plan.micro_batch * row.model.seq_len
    return tokens / time / gpus


def rms(rows: list[Row], constants: capacity_speed.Constants = capacity_speed.FITTED) -> float:
    """The root mean square of log(kit / published) over ``rows``: the error, as a fraction, a ratio's."""
    return math.sqrt(sum(math.log(measured_value(row, constants) / row.published) ** 2 for row in rows) / len(rows))


FITTED_NAMES = ("k0", "link_efficiency")
FIT_BOUNDS = {"k0": (0.0, 1024.0), "link_efficiency": (0.4, 1.0)}
FIT_START = {"k0": 256.0, "link_efficiency": 0.8}


def fit(rows: list[Row] | None = None) -> capacity_speed.Constants:
    """K0 and LINK_EFFICIENCY that make ``rms`` least over FIT_ROWS (or ``rows``), the measured constants as
    they are: a search one constant at a time, halving its steps, from FIT_START; rounded to what the kit
    stores (K0 to 1, LINK_EFFICIENCY to 0.01)."""
    rows = FIT_ROWS if rows is None else rows
    best = replace(capacity_speed.Constants(), **FIT_START)
    error = rms(rows, best)
    steps = {name: (high - low) / 4 for name, (low, high) in FIT_BOUNDS.items()}
    while max(steps[name] / (FIT_BOUNDS[name][1] - FIT_BOUNDS[name][0]) for name in FITTED_NAMES) >= 1e-4:
        moved = False
        for name in FITTED_NAMES:
            for sign in (1, -1):
                low, high = FIT_BOUNDS[name]
                trial = replace(best, **{name: min(max(getattr(best, name) + sign * steps[name], low), high)})
                trial_error = rms(rows, trial)
                if trial_error < error - 1e-12:
                    best, error, moved = trial, trial_error, True
        if not moved:
            steps = {name: step / 2 for name, step in steps.items()}
    return replace(best, k0=float(round(best.k0)), link_efficiency=round(best.link_efficiency, 2))
