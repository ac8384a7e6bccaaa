"""The kit's step time (grader/capacity_speed.py): each term as the docs say it, and the one it can measure on
a CPU, the shapes of the matmuls a layer runs, measured."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grader import capacity
from grader import capacity_plans as plans
from grader import capacity_speed as speed
from grader.checks.shared import capacity_cases as cases
from grader.rank.drivers.shared import capacity_model as cm

H100, A100 = speed.DEVICES["H100"], speed.DEVICES["A100"]
BIG = capacity.ModelSpec(layers=32, hidden=4096, heads=32, vocab=128256, seq_len=8192)


# --- one matmul -------------------------------------------------------------------------------------------


def test_a_large_matmul_reaches_the_measured_ceiling_and_no_more():
    for kind, device in speed.DEVICES.items():
        ceiling = device.matmul_ceiling * speed.SUSTAINED
        large = speed.matmul_efficiency(device.sms * 256, 128 * 64, 65536, kind)  # whole waves of whole tiles
        assert ceiling * 0.99 < large <= ceiling
    assert speed.matmul_efficiency(8192, 8192, 8192, "A100") == pytest.approx(0.72, abs=0.005)  # the docs' figures
    assert speed.matmul_efficiency(8192, 8192, 8192, "H100") == pytest.approx(0.65, abs=0.005)


def test_tiles_and_waves_are_paid_in_full():
    """257 rows cost what 512 do (two tiles of 256); 133 tiles on 132 SMs take two waves, as 264 do."""
    rate, k0 = 1e14, speed.K0  # a rate at which a 128-wide product is bound by its FLOPs, not its bytes
    assert speed.matmul_seconds(257, 128, 4096, H100, rate, k0) == pytest.approx(
        speed.matmul_seconds(512, 128, 4096, H100, rate, k0), rel=1e-12)
    one_wave = speed.matmul_seconds(132 * 256, 128, 4096, H100, rate, k0)
    assert speed.matmul_seconds(133 * 256, 128, 4096, H100, rate, k0) == pytest.approx(2 * one_wave)
    assert speed.matmul_seconds(264 * 256, 128, 4096, H100, rate, k0) == pytest.approx(2 * one_wave)


def test_a_short_inner_dimension_pays_each_tile_s_fixed_cost():
    """k / (k + K0) of a tile's time multiplies: halving k from 2 K0 to K0 takes 3/4 of the time, not 1/2."""
    k0 = speed.K0
    k = int(2 * k0)
    long_ = speed.matmul_seconds(8192, 8192, k, H100, 1e15, k0)
    short = speed.matmul_seconds(8192, 8192, k // 2, H100, 1e15, k0)
    assert short / long_ == pytest.approx((k // 2 + k0) / (k + k0), rel=1e-9)


def test_a_skinny_matmul_is_bound_by_memory():
    """One token through a 16K x 16K weight reads 512 MB for 0.5 GFLOP: the memory's time, not the FLOPs'."""
    t = speed.matmul_seconds(1, 16384, 16384, H100, 989e12, 0.0)
    assert t == pytest.approx((2 * (16384 + 16384 * 16384) + 2 * 16384) / H100.memory_bytes_per_s)


def test_efficiency_grows_with_the_matmul():
    """The products of a 1.7B model at tp 8 reach less of the peak than a 1T model's: why small models ran
    slower than one efficiency says (Megatron-LM 2021: 137 TFLOP/s at 1.7B, 163 at 1T)."""
    small = speed.matmul_efficiency(2048, 2304 * 4 // 8, 2304, "A100")
    large = speed.matmul_efficiency(2048, 25600 * 4 // 8, 25600, "A100")
    assert small < 0.85 * large


# --- the shapes, measured on a CPU ------------------------------------------------------------------------


class Products(TorchDispatchMode):
    """Every matrix product torch computes: (the two output dimensions, sorted; the inner one) -> count."""

    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            self.seen[(tuple(sorted((m, n))), k)] += batch
        return func(*args, **(kwargs or {}))


def model_products(model: capacity.ModelSpec, plan: capacity.Plan) -> Counter:
    """What capacity_speed costs for one layer and micro-batch: each linear map forward, then the input's
    gradient and the weight's; explicit attention per sequence and head, the scores QK^T (inner d) and
    times V (inner s) forward, and backward the probabilities' gradient (inner d) and V's, Q's and K's
    (inner s)."""
    out = Counter()
    for m, n, k, count in speed.linear_shapes(model, plan):
        for shape, inner in (((m, n), k), ((m, k), n), ((k, n), m)):
            out[(tuple(sorted(shape)), inner)] += count
    s, d = model.seq_len, model.hidden // model.heads
    batch = plan.micro_batch * model.heads
    out[((s, s), d)] += 2 * batch
    out[(tuple(sorted((s, d))), s)] += 4 * batch
    return out


@pytest.mark.parametrize("model", [
    capacity.ModelSpec(layers=1, hidden=64, heads=4, vocab=97, seq_len=24),
    capacity.ModelSpec(layers=1, hidden=64, heads=4, vocab=97, seq_len=24, kv_heads=2, ffn=96, mlp="swiglu",
                       norm="rmsnorm", bias=False, positions="rope", dropout=False),
    capacity.ModelSpec(layers=1, hidden=64, heads=4, vocab=97, seq_len=24, experts=4, top_k=2, shared_experts=1,
                       mlp="swiglu", bias=False),
], ids=["gpt", "frontier", "experts"])
def test_the_matmuls_a_layer_runs_are_the_ones_the_model_costs(model):
    """The kit's own layer (the one 41 and 42's measured runs train), forward and backward on one process:
    every matrix product torch computes has a shape the model costs, as many times, and no other."""
    plan = capacity.Plan(micro_batch=2)
    sent = cases.measure_kwargs(model, plan)  # as a measured run's rank gets them
    spec, view = cm.spec_of(sent["model"], sent["layout"]), cm.plan_of(sent["plan"], sent["layout"])
    params = {name.split(".", 2)[2]: value.requires_grad_() for name, value in cm.full_parameters(spec, 0).items()
              if name.startswith("layers.0.")}
    layer = cm.Layer(params, spec, view, {}, 0, dropout=0.1)
    x = torch.randn(plan.micro_batch, model.seq_len, model.hidden, requires_grad=True)
    with Products() as seen:
        layer(x).sum().backward()
    assert seen.seen == model_products(model, plan)


def test_the_model_s_own_count_of_those_products_is_42_s_flops():
    """Forward, backward twice: the products' FLOPs are 3 x 42's layer FLOPs (FlopCounterMode's count)."""
    model, plan = capacity.ModelSpec(layers=2, hidden=256, heads=8, vocab=1000, seq_len=128), capacity.Plan(micro_batch=2)
    linear = sum(2 * m * n * k * count for m, n, k, count in speed.linear_shapes(model, plan))
    assert 3 * (linear + capacity.attention_core_flops(model, plan)) == 3 * capacity.layer_flops(model, plan)


# --- the step --------------------------------------------------------------------------------------------


def kit(model, plan, gpus=None, kind="H100", **cluster):
    base = plans.GPU_KINDS[kind]
    c = replace(plans.on(base, gpus or plan.world_size), **cluster)
    return speed.breakdown(model, plan, c, kind)


def test_cluster_mfu_is_not_read():
    plan = capacity.Plan(dp=8, tp=8, micro_batches=8, sp=True, vocab_parallel=True, attention="flash")
    c = plans.on(plans.H100, 64)
    assert speed.step_time(BIG, plan, c, "H100") == speed.step_time(BIG, plan, replace(c, mfu=0.1), "H100")


def test_a_float8_plan_multiplies_faster_and_pays_its_casts():
    plan = capacity.Plan(dp=8, micro_batches=4, attention="flash", zero=1)
    bf16, fp8 = kit(BIG, plan), kit(BIG, replace(plan, precision="fp8-mixed"))
    assert fp8.matmul_s < 0.65 * bf16.matmul_s and fp8.attention_s == bf16.attention_s
    assert fp8.memory_s > bf16.memory_s and fp8.step.total_s < bf16.step.total_s
    assert capacity.training_memory(BIG, replace(plan, precision="fp8-mixed")) == capacity.training_memory(BIG, plan)
    with pytest.raises(capacity.PlanError, match="the A100 has none"):
        kit(BIG, replace(plan, precision="fp8-mixed"), kind="A100")


def test_flash_attention_runs_half_the_scores_of_a_causal_mask():
    """Its time is the half of its counted FLOPs a causal mask leaves, at FlashAttention-2's fraction."""
    plan = capacity.Plan(attention="flash", micro_batch=1)
    cost = speed.layer_cost(BIG, plan, H100, 989e12, speed.FITTED)
    counted = speed.FLASH_PASSES * capacity.attention_core_flops(BIG, plan)
    assert cost.attention_s == pytest.approx(counted / 2 / (989e12 * H100.flash_utilization))


def test_memory_bound_work_weighs_more_on_small_layers_and_on_the_h100():
    def share(hidden, kind):
        model = capacity.ModelSpec(layers=4, hidden=hidden, heads=hidden // 128, vocab=32000, seq_len=2048)
        cost = speed.layer_cost(model, capacity.Plan(micro_batch=4, attention="flash"), speed.DEVICES[kind],
                                plans.GPU_KINDS[kind].peak_flops, speed.FITTED)
        return cost.memory_s / cost.total()
    assert share(1024, "A100") > share(8192, "A100") and share(4096, "H100") > share(4096, "A100")
    assert 0.02 < share(4096, "A100") < 0.08  # the docs' "about 5 %"


def test_backward_s_tensor_parallel_traffic_hides_under_the_weight_gradients():
    plan = capacity.Plan(dp=8, tp=8, micro_batches=8, sp=True, vocab_parallel=True, attention="flash")
    with_, without = kit(BIG, plan), kit(BIG, replace(plan, tp_overlap=False))
    assert 0 < with_.hidden_tp_s and without.hidden_tp_s == 0
    assert with_.step.tp_s == pytest.approx(without.step.tp_s - with_.hidden_tp_s)
    assert with_.hidden_tp_s <= plan.micro_batches * BIG.layers * speed.layer_cost(
        BIG, plan, H100, 989e12, speed.FITTED).weight_grad_s


def test_data_parallel_traffic_hides_only_where_the_schedule_lets_it():
    """ZeRO 1 reduces once a step, behind the last micro-batch's backward, and gathers behind the first one's
    forward; ZeRO 2 reduces after each micro-batch, behind everything after the first forward; without
    overlap nothing hides; interleaved chunks finish their backwards early and widen the reduction's window."""
    slow = dict(inter_node_bandwidth=5e9)
    plan = capacity.Plan(dp=64, zero=1, micro_batches=16, attention="flash")
    cluster = replace(plans.on(plans.H100, 64), **slow)

    def seconds(p, name):
        return sum(speed.collective_seconds(p, cluster, speed.FITTED, *entry)
                   for entry in capacity.collective_list(BIG, p) if entry[0] == "dp" and entry[1] == name)

    one = kit(BIG, plan, **slow)
    compute = one.step.compute_s - speed.optimizer_seconds(BIG, plan, H100)
    micro = compute / 16
    assert one.step.exposed_dp_s == pytest.approx(max(0, seconds(plan, "reduce-scatter") - micro * 2 / 3)
                                                  + max(0, seconds(plan, "all-gather") - micro / 3))
    two = kit(BIG, replace(plan, zero=2), **slow)
    assert two.step.exposed_dp_s == pytest.approx(max(0, seconds(replace(plan, zero=2), "reduce-scatter")
                                                      - (compute - micro / 3))
                                                  + max(0, seconds(plan, "all-gather") - micro / 3))
    none = kit(BIG, replace(plan, dp_overlap=False), **slow)
    assert none.step.exposed_dp_s == pytest.approx(none.step.dp_s)
    assert none.step.exposed_dp_s > one.step.exposed_dp_s
    piped = capacity.Plan(dp=8, pp=4, zero=1, micro_batches=16, attention="flash")
    assert speed._windows(replace(piped, vpp=4))[0] > speed._windows(piped)[0] == 1


def test_the_slowest_of_n_ranks():
    """The wait is the expected largest of N normal spreads of JITTER: none on one GPU, 1.42 spreads on 8 (the
    figure JITTER was measured with), about 9 % of the step at 16,384."""
    plan = capacity.Plan(attention="flash", micro_batches=2)
    assert kit(BIG, plan).straggler_s == 0
    for dp in (64, 16384):
        b = kit(BIG, replace(plan, dp=dp, zero=3))
        share = b.straggler_s / (b.step.total_s - b.straggler_s - b.step.exposed_dp_s)
        assert share == pytest.approx(speed.JITTER * speed.slowest_of(dp))
    assert speed.slowest_of(8) == pytest.approx(1.4236, abs=0.015)  # the exact expected maximum of 8 normals
    assert speed.JITTER * speed.slowest_of(16384) == pytest.approx(0.091, abs=0.002)
    assert speed.slowest_of(16384) < math.sqrt(2 * math.log(16384))  # the limit overstates it at any real N


def test_a_ring_across_nodes_runs_on_every_card_its_members_have():
    """Each GPU has its own network card: a data-parallel ring with 4 members in each node (tp 2) runs 4 rings
    at once, one through each card; with one member a node (tp 8), one card; never faster than NVLink."""
    cluster = plans.on(plans.H100, 64)
    for tp, cards in ((8, 1), (2, 4), (1, 8)):
        plan = capacity.Plan(dp=64 // tp, tp=tp)
        bandwidth = speed.ring_bandwidth(plan, cluster, "dp", "all-reduce")
        assert bandwidth == min(cards * cluster.inter_node_bandwidth, cluster.intra_node_bandwidth)
        assert speed.ring_bandwidth(plan, cluster, "dp", "all-to-all") == cluster.inter_node_bandwidth
    inside = capacity.Plan(dp=4, tp=2)
    assert speed.ring_bandwidth(inside, cluster, "dp", "all-reduce") == cluster.intra_node_bandwidth


def test_the_last_stage_runs_the_head_and_sets_the_pace():
    """With equal stages the last one also computes the head and the loss for every micro-batch: the bubble
    holds m times that extra work (the busiest rank's pace), and a stage with one layer fewer for it (as
    Llama 3 trims its last) gives the time back."""
    model = capacity.ModelSpec(layers=8, hidden=2048, heads=16, vocab=128256, seq_len=4096)
    plan = capacity.Plan(dp=1, tp=1, pp=4, micro_batches=16, attention="flash")
    even, trimmed = kit(model, plan), kit(model, replace(plan, stage_layers=(3, 2, 2, 1)))
    head = speed.head_seconds(model, plan, H100, 989e12, speed.FITTED)
    assert even.step.bubble_s > 16 * head
    assert trimmed.step.total_s < even.step.total_s


def test_tp_comm_overlap_hides_forward_s_collectives_too():
    """--tp-comm-overlap: every tensor-parallel collective of a layer under its products (Transformer Engine's
    userbuffers), at most the products' time; without it, only backward's under the weight gradients'."""
    plan = capacity.Plan(tp=8, sp=True, micro_batches=4, attention="flash", vocab_parallel=True)
    some, every = kit(BIG, plan), kit(BIG, replace(plan, tp_comm_overlap=True))
    assert every.hidden_tp_s > some.hidden_tp_s > 0
    assert every.step.tp_s < some.step.tp_s
    assert every.hidden_tp_s <= every.matmul_s


def test_pp_overlap_takes_the_sends_off_the_critical_path():
    plan = capacity.Plan(pp=4, vpp=2, dp=2, micro_batches=8, attention="flash")
    cluster = replace(plans.on(plans.H100, 8), gpus_per_node=2)
    waits, overlapped = (speed.breakdown(BIG, p, cluster, "H100") for p in (plan, replace(plan, pp_overlap=True)))
    assert waits.step.pp_s > 0 and overlapped.step.pp_s == 0
    assert overlapped.hidden_pp_s == pytest.approx(waits.step.pp_s)
    assert overlapped.step.total_s < waits.step.total_s


def test_the_step_adds_up():
    plan = capacity.Plan(dp=8, tp=4, pp=2, micro_batches=8, sp=True, vocab_parallel=True, attention="flash", zero=1)
    b = kit(BIG, plan)
    t = b.step
    busy = t.compute_s + t.tp_s + t.pp_s + t.cp_s + t.ep_s
    assert t.total_s == pytest.approx(busy + t.bubble_s + t.exposed_dp_s + b.straggler_s)
    assert t.flops == capacity.flops(BIG, plan)
    assert b.matmul_s + b.attention_s + b.memory_s == pytest.approx(t.compute_s)
