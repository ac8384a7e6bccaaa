"""Demonstrations for the quiz topic 'capacity' (grader/quiz/bank/capacity.toml).

Each answer is computed from the kit's own cost model, ``grader.capacity`` (the formulas the stubs
of exercises 41-43 state): bytes per rank, ring traffic, FLOPs, step time and the plan search. Each test asserts that the keyed choice is what the
model gives and that every distractor's figure is not. Pure Python: no torch, no process group.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from grader.capacity import (
    ModelSpec,
    Plan,
    chunk_layers,
    collectives,
    communication,
    element_bytes,
    flops,
    in_flight,
    latency_steps,
    layer_activations,
    layer_flops,
    layer_params,
    link,
    optimizer_bytes_per_param,
    ring_factor,
    shard,
    step_time,
    total_params,
    training_memory,
)
from grader.capacity_plans import A100, SCENARIOS, hardware_flops, model_flops, on
from grader.capacity_published import LLAMA_ROWS, MEGATRON_ROWS

GB = 1e9
MODEL_8B, CLUSTER_8B, TOKENS_8B = SCENARIOS["8B on 64 GPUs"]
MODEL_70B, CLUSTER_70B, TOKENS_70B = SCENARIOS["70B on 1,024 GPUs"]
SMALL = ModelSpec(layers=4, hidden=256, heads=4, vocab=1000, seq_len=64)


def keyed(value: float, right: float, wrong: list[float], digits: int = 1) -> None:
    """``value`` is the keyed choice to its ``digits`` (half a unit of the last digit either way) and
    lies nearer to it than to any distractor."""
    assert abs(value - right) <= 0.5 * 10**-digits + 1e-9, (value, right)
    assert all(abs(value - right) < abs(value - w) for w in wrong), (value, wrong)


def model_states(model: ModelSpec, plan: Plan) -> float:
    memory = training_memory(model, plan)
    return memory.params + memory.grads + memory.optimizer


# --- memory of the model states ---------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_mixed_precision_adam_holds_16_bytes_per_parameter_as_float32_adam_does(precision):
    plan = Plan(precision=precision)
    per_parameter = 2 * element_bytes(plan) + optimizer_bytes_per_param(plan)  # weights, grads, optimizer
    assert per_parameter == 16
    assert model_states(SMALL, plan) == 16 * total_params(SMALL)  # the whole model, unsharded
    if precision == "bf16-mixed":
        assert (element_bytes(plan), element_bytes(plan), optimizer_bytes_per_param(plan)) == (2, 2, 12)
        assert optimizer_bytes_per_param(plan) != 8 and per_parameter not in (8, 12, 20)


PSI, N_D = 7_500_000_000, 64  # the ZeRO paper's figure 1


def zero_bytes(parameters: int, ranks: int, stage: int) -> float:
    """Model-state bytes per rank at a ZeRO stage, from the model's per-parameter bytes and its shard()."""
    plan = Plan(dp=ranks, zero=stage)
    e, k, part = element_bytes(plan), optimizer_bytes_per_param(plan), shard(parameters, ranks)
    return (e * (part if stage >= 3 else parameters) + e * (part if stage >= 2 else parameters)
            + k * (part if stage >= 1 else parameters))


def test_zero_figure_one_per_stage_from_the_per_parameter_bytes():
    figures = [round(zero_bytes(PSI, N_D, stage) / GB, 1) for stage in range(4)]
    assert figures == [120.0, 31.4, 16.6, 1.9]  # the figure's baseline and stages 1, 2 and 3
    # training_memory gives the same bytes per parameter on a ModelSpec (the 8B scenario's 7.53e9)
    for stage in range(4):
        per_parameter = model_states(MODEL_8B, Plan(dp=N_D, zero=stage)) / total_params(MODEL_8B)
        assert per_parameter * PSI / GB == pytest.approx(zero_bytes(PSI, N_D, stage) / GB, rel=1e-6)
    keyed(zero_bytes(PSI, N_D, 2) / GB, 16.6, [31.4, 1.9, 90.5])
    # 90.5: weights and gradients sharded, the 12 bytes of Adam kept whole
    assert round((4 * shard(PSI, N_D) + 12 * PSI) / GB, 1) == 90.5


def test_zero_stage_1_keeps_the_gradients_whole():
    plan = Plan(dp=8, zero=1)
    memory = training_memory(MODEL_8B, plan)
    assert memory.grads == training_memory(MODEL_8B, Plan(dp=8)).grads  # the gradients are whole
    assert memory.optimizer == 12 * shard(total_params(MODEL_8B), 8)  # the optimizer states are an eighth
    keyed(zero_bytes(PSI, 8, 1) / GB, 41.3, [28.1, 15.0, 37.5])
    assert round(zero_bytes(PSI, 8, 2) / GB, 1) == 28.1  # gradients sharded too: stage 2
    assert round(zero_bytes(PSI, 8, 3) / GB, 1) == 15.0  # weights too: stage 3
    assert round((4 * PSI + 8 * shard(PSI, 8)) / GB, 1) == 37.5  # without the float32 master weights


# --- traffic ------------------------------------------------------------------------------------------


def test_a_ring_all_reduce_sends_nearly_twice_the_buffer_whatever_the_ring():
    for n in (2, 8, 1024):  # a reduce-scatter and an all-gather are the all-reduce's two halves
        assert ring_factor("reduce-scatter", n) + ring_factor("all-gather", n) == ring_factor("all-reduce", n)
        assert ring_factor("all-reduce", n) == 2 * (n - 1) / n
    gradients = element_bytes(Plan()) * total_params(MODEL_8B)
    assert round(gradients / GB) == 15
    seconds = {}
    for gpus in (64, 1024):
        cluster, plan = on(CLUSTER_8B, gpus), Plan(dp=gpus)
        assert collectives(MODEL_8B, plan) == {("dp", "all-reduce"): (1, gradients)}
        assert link(cluster, plan, "dp") == (50e9, 2e-5)  # the group spans nodes
        seconds[gpus] = step_time(MODEL_8B, plan, cluster).dp_s
        assert seconds[gpus] == pytest.approx(gradients * ring_factor("all-reduce", gpus) / 50e9
                                              + 2 * (gpus - 1) * 2e-5)
    keyed(seconds[64], 0.60, [0.30], digits=2)
    keyed(seconds[1024], 0.64, [0.32, 9.6, 0.04], digits=2)
    one_half = gradients * ring_factor("reduce-scatter", 64) / 50e9
    assert round(one_half, 2) == 0.30


def test_zero_2_sends_what_dp_sends_and_zero_3_half_as_much_again():
    assert total_params(MODEL_8B) % 64 == 0  # no padding: the ratios are exact
    sent = {stage: sum(communication(MODEL_8B, Plan(dp=64, zero=stage, micro_batches=1)).dp.values())
            for stage in range(4)}
    assert sent[1] == sent[0] and sent[2] == sent[0]
    assert sent[3] == 1.5 * sent[0]
    calls = collectives(MODEL_8B, Plan(dp=64, zero=3, micro_batches=1))
    assert calls[("dp", "all-gather")][0] == 2 and calls[("dp", "reduce-scatter")][0] == 1
    assert sent[2] / sent[0] not in (0.5, 1.5) and sent[3] / sent[0] not in (1.0, 2.0, 3.0)


# --- activations ----------------------------------------------------------------------------------------


def sbh(model: ModelSpec, plan: Plan) -> float:
    return model.seq_len * plan.micro_batch * model.hidden


def test_selective_recomputation_removes_the_attention_term():
    s, h, a = MODEL_8B.seq_len, MODEL_8B.hidden, MODEL_8B.heads
    none, selective = (layer_activations(MODEL_8B, Plan(recompute=r)) for r in ("none", "selective"))
    assert none == sbh(MODEL_8B, Plan()) * (34 + 5 * a * s / h)  # Korthikanti et al.'s formula, 16-bit
    assert selective == 34 * sbh(MODEL_8B, Plan())
    saved = (none - selective) / none
    keyed(100 * saved, 90, [10, 36, 50], digits=-1)
    assert round(100 * selective / none) == 10  # what it keeps, not what it saves
    assert round(100 * 2 * a * s / h / (34 + 5 * a * s / h)) == 36  # the softmax's output alone


def test_tensor_parallelism_divides_all_but_the_replicated_ten():
    plan = Plan(tp=8)
    one = layer_activations(MODEL_8B, Plan())
    eight = layer_activations(MODEL_8B, plan)
    unit = sbh(MODEL_8B, plan)
    assert one / unit == 354 and round(one / GB, 1) == 11.9
    assert eight / unit == 10 + 24 / 8 + 320 / 8 == 53
    keyed(eight / GB, 1.78, [1.48, 11.9, 2.48], digits=2)
    assert round(one / 8 / GB, 2) == 1.48  # everything divided
    assert round((10 + 24 + 320 / 8) * unit / GB, 2) == 2.48  # the attention's term alone divided


def test_full_recomputation_keeps_each_layers_input():
    plan = Plan(recompute="full")
    per_layer = layer_activations(MODEL_8B, plan)
    assert per_layer == 2 * sbh(MODEL_8B, plan)
    whole = training_memory(MODEL_8B, plan).activations  # 32 layers, one micro-batch in flight
    keyed(whole / GB, 2.1, [0.1, 4.3, 36.5])
    assert round(per_layer / 1e6) == 67  # the first layer's input alone
    assert round(2 * whole / GB, 1) == 4.3
    assert round(training_memory(MODEL_8B, Plan(recompute="selective")).activations / GB, 1) == 36.5


# --- pipelines ------------------------------------------------------------------------------------------


def test_the_bubble_is_the_same_under_gpipe_and_1f1b():
    p, m = 4, 8
    shares = []
    for schedule in ("gpipe", "1f1b"):
        plan = Plan(dp=64 // p, pp=p, micro_batches=m, schedule=schedule)
        time = step_time(MODEL_8B, plan, CLUSTER_8B)
        shares.append(time.bubble_s / time.total_s)
    assert shares[0] == pytest.approx(shares[1])
    assert shares[0] == pytest.approx((p - 1) / (m + p - 1))  # 3/11
    keyed(100 * shares[0], 27, [38, 0, 14], digits=0)
    assert shares[1] > 0 and (p - 1) / m == 0.375  # (p - 1)/m is against the compute, not the step


def test_1f1b_holds_at_most_p_micro_batches_on_the_first_stage():
    p, m = 4, 8
    gpipe, one_f_one_b = (Plan(dp=16, pp=p, micro_batches=m, schedule=s) for s in ("gpipe", "1f1b"))
    assert (in_flight(gpipe, 0), in_flight(one_f_one_b, 0)) == (8, 4)
    assert in_flight(one_f_one_b, p - 1) == 1  # the last stage's figure
    memory = [training_memory(MODEL_8B, plan).activations for plan in (gpipe, one_f_one_b)]
    assert memory[0] == 2 * memory[1]
    assert (in_flight(one_f_one_b, 0), in_flight(gpipe, 0)) not in ((8, 8), (1, 8))
    more = Plan(dp=16, pp=p, micro_batches=32)  # more micro-batches: a smaller bubble, the same memory
    assert training_memory(MODEL_8B, more).activations == memory[1]


# --- FLOPs and time -------------------------------------------------------------------------------------

WIDE = ModelSpec(layers=4, hidden=8192, heads=64, vocab=256, seq_len=8)  # attention's s^2 terms negligible


def test_a_step_costs_6_flops_per_parameter_per_token():
    plan = Plan(pp=2)  # stage 0: layers alone, no head
    tokens = WIDE.seq_len * plan.micro_batch
    layers = WIDE.layers // plan.pp
    per_parameter_token = flops(WIDE, plan) / (layers * layer_params(WIDE, 1) * tokens)
    assert per_parameter_token == pytest.approx(6, rel=1e-3)
    forward = layers * layer_flops(WIDE, plan)
    assert flops(WIDE, plan) == 3 * forward  # backward is twice the forward
    assert round(per_parameter_token) not in (3, 4, 8)


def test_full_recomputation_costs_8_flops_per_parameter_per_token():
    plan, full = Plan(pp=2), Plan(pp=2, recompute="full")
    layers = WIDE.layers // plan.pp
    assert flops(WIDE, full) - flops(WIDE, plan) == layers * layer_flops(WIDE, plan)  # one more forward
    per_parameter_token = flops(WIDE, full) / (layers * layer_params(WIDE, 1) * WIDE.seq_len)
    assert per_parameter_token == pytest.approx(8, rel=1e-3)
    assert round(per_parameter_token) not in (12, 7, 6)
    selective = flops(MODEL_8B, Plan(recompute="selective")) / flops(MODEL_8B, Plan())
    assert round(100 * (selective - 1)) == 8  # the attention's matmuls alone, in the 8B scenario


def test_the_8b_step_computes_for_about_7_seconds_at_the_h100s_efficiency():
    cluster = CLUSTER_8B
    assert (cluster.gpus, cluster.peak_flops, cluster.mfu, TOKENS_8B) == (64, 989e12, 0.54, 4 * 2**20)
    sequences = TOKENS_8B // MODEL_8B.seq_len
    plan = Plan(dp=64, micro_batches=sequences // 64)
    time = step_time(MODEL_8B, plan, cluster)
    step_flops = time.flops * plan.dp  # every data-parallel rank computes the same
    assert round(step_flops / 1e17, 1) == 2.3
    keyed(time.compute_s, 6.7, [3.6, 2.0, 430.0])
    assert round(step_flops / (64 * cluster.peak_flops), 1) == 3.6  # the peak, without the efficiency
    assert round(step_flops / (64 * cluster.peak_flops) * cluster.mfu, 1) == 2.0
    assert round(time.compute_s * 64, -1) == 430  # on one GPU
    six_n = 6 * total_params(MODEL_8B) * TOKENS_8B / (64 * cluster.peak_flops * cluster.mfu)
    assert round(six_n, 1) == 5.5


# --- tensor parallelism --------------------------------------------------------------------------------


@pytest.mark.parametrize("recompute, per_layer", [("none", 4), ("selective", 4), ("full", 6)])
def test_tensor_parallelism_all_reduces_4_times_per_layer_and_6_with_full_recomputation(recompute, per_layer):
    plan = Plan(tp=4, micro_batches=2, recompute=recompute)
    calls, size = collectives(SMALL, plan)[("tp", "all-reduce")]
    assert calls == plan.micro_batches * SMALL.layers * per_layer
    assert size == element_bytes(plan) * SMALL.seq_len * plan.micro_batch * SMALL.hidden  # the whole activation
    assert calls // (plan.micro_batches * SMALL.layers) not in ({"none": (2, 8), "selective": (2, 8),
                                                                 "full": (4, 8)}[recompute])


def test_tensor_parallelism_across_nodes_all_reduces_about_ten_times_slower():
    cluster = CLUSTER_70B
    assert (cluster.gpus_per_node, cluster.intra_node_bandwidth, cluster.inter_node_bandwidth) == (8, 450e9, 50e9)
    seconds, sent = {}, {}
    for tp in (8, 16):
        plan = Plan(dp=cluster.gpus // tp, tp=tp, micro_batches=4)
        bandwidth, latency = link(cluster, plan, "tp")
        assert bandwidth == (cluster.intra_node_bandwidth if tp == 8 else cluster.inter_node_bandwidth)
        calls, size = collectives(MODEL_70B, plan)[("tp", "all-reduce")]
        sent[tp] = size * ring_factor("all-reduce", tp)
        seconds[tp] = sent[tp] / bandwidth + latency_steps("all-reduce", tp) * latency
        assert step_time(MODEL_70B, plan, cluster).tp_s == pytest.approx(calls * seconds[tp])
    assert sent[16] / sent[8] == pytest.approx(1.875 / 1.75)  # nearly the same bytes per rank
    ratio = seconds[16] / seconds[8]
    assert 9 < ratio < 11
    assert not 0.4 < ratio < 2.5  # neither half, nor the same, nor twice


# --- the kit's scenarios ------------------------------------------------------------------------------


def test_llama_3_405b_holds_16_micro_batches_of_7_layers_on_its_first_gpu():
    row = LLAMA_ROWS[1]  # 16,384 GPUs, TP 8, PP 16, DP 128, 8,192 tokens
    model, plan = row.model, row.plan
    assert (plan.tp, plan.sp, plan.pp, plan.vpp, plan.micro_batches, plan.recompute) == (8, True, 16, 8, 16, "none")
    layers = sum(len(chunk) for chunk in chunk_layers(model, plan))
    per_layer = layer_activations(model, plan)
    assert layers == 7 and round(per_layer / GB, 2) == 0.64
    memory = training_memory(model, plan)
    assert memory.activations == 16 * layers * per_layer  # every forward before the first backward: m == p
    keyed(memory.activations / GB, 72, [81, 4.5, 177], digits=0)
    assert round(126 * per_layer / GB) == 81  # L layers' worth: a first stage of 1F1B (Korthikanti et al.)
    assert round(layers * per_layer / GB, 1) == 4.5
    whole = layer_activations(model, replace(plan, sp=False))
    assert round(16 * layers * whole / GB) == 177  # without sequence parallelism
    assert round(memory.total / GB) == 78 and memory.total <= 80e9
    assert round(memory.params / GB, 1) == 6.1 and round((memory.grads + memory.optimizer) / GB, 2) == 0.38
    assert plan.grad_fp32 and memory.grads == 2 * training_memory(model, replace(plan, grad_fp32=False)).grads


def test_interleaving_divides_the_bubble_by_the_chunks():
    model = ModelSpec(layers=128, hidden=1024, heads=8, vocab=1024, seq_len=256)
    cluster = on(CLUSTER_8B, 16)
    shares = {}
    for vpp in (1, 8):
        plan = Plan(pp=16, vpp=vpp, micro_batches=32)
        time = step_time(model, plan, cluster)
        shares[vpp] = time.bubble_s / time.total_s
    keyed(100 * shares[8], 5.5, [32, 47, 0])
    assert shares[8] == pytest.approx(15 / (8 * 32 + 15)) and shares[1] == pytest.approx(15 / 47)
    assert round(100 * 15 / 32) == 47  # (p - 1) / m: against the compute, not the step
    sends = {vpp: collectives(model, Plan(pp=16, vpp=vpp, micro_batches=32))[("pp", "send")][0] for vpp in (1, 8)}
    assert sends == {1: 32, 8: 32 * 15}  # each chunk's output forward, each input gradient but the first's back


def test_megatron_s_163_tflops_are_39_percent_mfu():
    row = MEGATRON_ROWS[-1]  # 1008B, TP 8, PP 64, 3,072 A100s, 163 TFLOP/s per GPU
    assert row.published == 163 and row.plan.recompute == "full" and A100.peak_flops == 312e12
    ratio = model_flops(row.model, row.plan) / hardware_flops(row.model, row.plan)
    assert ratio == pytest.approx(0.75, abs=0.001)
    keyed(100 * 163e12 * ratio / A100.peak_flops, 39, [52, 69, 26], digits=0)
    assert round(100 * 163e12 / A100.peak_flops) == 52 and round(52 * 4 / 3) == 69 and 52 / 2 == 26
