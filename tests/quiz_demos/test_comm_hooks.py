"""Demonstrations for the quiz topic 'comm-hooks' (grader/quiz/bank/comm-hooks.toml).

One two-rank gloo world runs every scenario (module fixture); the tests assert on what it saw.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from quiz_demos.world import run_world


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(model, x):
    # Squared outputs and a tanh keep the weight gradient from being rank 1 by construction.
    return (model(x) ** 2).sum()


def _grads(module):
    return [p.grad.detach().clone() for p in module.parameters()]


def _reference_average(x, world_size):
    """Gradients of each rank's batch on a plain model, averaged by hand."""
    model = _model()
    _loss(model, x).backward()
    grads = _grads(model)
    for g in grads:
        dist.all_reduce(g)
        g /= world_size
    return grads


def _largest_gap(grads, reference):
    return max((g - r).abs().max().item() for g, r in zip(grads, reference))


def _other_rank_gap(grads):
    """Largest difference between this rank's gradients and the other rank's (world of 2)."""
    gaps = []
    for g in grads:
        both = [torch.empty_like(g) for _ in range(2)]
        dist.all_gather(both, g.contiguous())
        gaps.append((both[0] - both[1]).abs().max().item())
    return max(gaps)


def noop_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def sum_hook(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def fp16_sum_without_division_hook(state, bucket):
    compressed = bucket.buffer().to(torch.float16)
    fut = dist.all_reduce(compressed, async_op=True).get_future()
    return fut.then(lambda f: bucket.buffer().copy_(f.value()[0]))


def tensor_hook(state, bucket):
    return bucket.buffer()


def _recording_hook(seen, names):
    def record_hook(state, bucket):
        seen.append({"index": bucket.index(), "is_last": bucket.is_last(),
                     "numel": bucket.buffer().numel(), "dtype": str(bucket.buffer().dtype),
                     "params": [names[id(p)] for p in bucket.parameters()],
                     "param_numel": sum(p.numel() for p in bucket.parameters()),
                     "grads_match": all(torch.equal(g, p.grad) for g, p in
                                        zip(bucket.gradients(), bucket.parameters())) or None})
        return default_hooks.allreduce_hook(None, bucket)
    return record_hook


class MixedDtypes(nn.Module):
    """A float32 layer, then a float64 one."""

    def __init__(self):
        super().__init__()
        self.f32 = nn.Linear(16, 16)
        self.f64 = nn.Linear(16, 16).double()

    def forward(self, x):
        return self.f64(self.f32(x).double())


def _ddp(hook, state=None, **kwargs):
    model = nn.parallel.DistributedDataParallel(_model(), **kwargs)
    if hook is not None:
        model.register_comm_hook(state, hook)
    return model


def comm_hooks_main(ctx) -> dict:
    with ctx.group():
        return hook_observations(ctx.rank, ctx.world_size)


def hook_observations(rank: int, world_size: int) -> dict:
    torch.manual_seed(100 + rank)
    x = torch.randn(4, 8)
    reference = _reference_average(x, world_size)
    out = {}

    plain = _ddp(None)
    _loss(plain, x).backward()
    out["default_gap"] = _largest_gap(_grads(plain.module), reference)

    noop = _ddp(noop_hook)
    _loss(noop, x).backward()
    out["noop_gap_to_other_rank"] = _other_rank_gap(_grads(noop.module))

    summed = _ddp(sum_hook)
    _loss(summed, x).backward()
    out["sum_ratio"] = [(g / r).median().item() for g, r in zip(_grads(summed.module), reference)]

    # Gradients near float16's limit (65504): each rank's is 40000.
    big = _ddp(default_hooks.fp16_compress_hook)
    naive = _ddp(fp16_sum_without_division_hook)
    for model in (big, naive):
        for p in model.parameters():
            p.register_hook(lambda g: torch.full_like(g, 40000.0))
        _loss(model, x).backward()
    out["fp16_hook_grad"] = big.module[0].weight.grad[0, 0].item()
    out["fp16_hook_dtype"] = str(big.module[0].weight.grad.dtype)
    out["naive_fp16_grad"] = naive.module[0].weight.grad[0, 0].item()

    small = _ddp(default_hooks.fp16_compress_hook)
    _loss(small, x).backward()
    scale = max(r.abs().max().item() for r in reference)
    out["fp16_relative_gap"] = _largest_gap(_grads(small.module), reference) / scale

    try:
        _ddp(default_hooks.bf16_compress_hook)
        out["bf16_register"] = "accepted"
    except TypeError as exc:
        out["bf16_register"] = f"TypeError: {exc}"

    twice = _ddp(noop_hook)
    try:
        twice.register_comm_hook(None, noop_hook)
        out["second_register"] = "accepted"
    except RuntimeError as exc:
        out["second_register"] = f"RuntimeError: {exc}"

    returns_tensor = _ddp(tensor_hook)
    try:
        _loss(returns_tensor, x).backward()
        out["tensor_hook"] = "accepted"
    except RuntimeError as exc:
        out["tensor_hook"] = f"RuntimeError: {exc}"

    # Three layers of 1 MiB of weights each, 1 MiB buckets.
    seen: list = []
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 512))
    names = {id(p): name for name, p in wide.named_parameters()}
    recorded = nn.parallel.DistributedDataParallel(wide, bucket_cap_mb=1)
    recorded.register_comm_hook(None, _recording_hook(seen, names))
    out["buckets_per_iteration"] = []
    for _ in range(2):
        seen.clear()
        recorded.zero_grad()
        recorded(torch.randn(2, 512)).sum().backward()
        out["buckets_per_iteration"].append(list(seen))

    # A float32 and a float64 layer, far below the default cap.
    mixed_seen: list = []
    torch.manual_seed(0)
    mixed = MixedDtypes()
    mixed_names = {id(p): name for name, p in mixed.named_parameters()}
    dtypes = {name: str(p.dtype) for name, p in mixed.named_parameters()}
    mixed_ddp = nn.parallel.DistributedDataParallel(mixed)
    mixed_ddp.register_comm_hook(None, _recording_hook(mixed_seen, mixed_names))
    out["mixed_dtype_buckets"] = []
    for _ in range(2):
        mixed_seen.clear()
        mixed_ddp.zero_grad()
        mixed_ddp(torch.randn(4, 16)).sum().backward()
        out["mixed_dtype_buckets"].append([{"dtype": b["dtype"], "param_dtypes": sorted({dtypes[n] for n in b["params"]})}
                                           for b in mixed_seen])
    out["mixed_grad_dtypes"] = sorted({str(p.grad.dtype) for p in mixed.parameters()})

    # PowerSGD: exact allreduce for the first start_powerSGD_iter steps, rank-1 approximation after.
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                   start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
    compressed = _ddp(powersgd.powerSGD_hook, state=state)
    steps = []
    for _ in range(4):
        compressed.zero_grad()
        _loss(compressed, x).backward()
        grads = _grads(compressed.module)
        steps.append({"weight_gap": (grads[0] - reference[0]).abs().max().item(),
                      "bias_gap": (grads[1] - reference[1]).abs().max().item(),
                      "gap_to_other_rank": _other_rank_gap(grads)})
    out["powersgd"] = steps
    out["powersgd_error_numels"] = [e.numel() for e in state.error_dict.values()]
    out["bucket_numel"] = sum(p.numel() for p in compressed.parameters())
    return out


@pytest.fixture(scope="module")
def hooks(session):
    return run_world(session, "quiz_demos.test_comm_hooks:comm_hooks_main", 2, timeout_s=180)


pytestmark = pytest.mark.slow


def test_default_ddp_averages(hooks):
    for rank, seen in enumerate(hooks):
        assert seen["default_gap"] < 1e-6, f"rank {rank}"


def test_hook_that_communicates_nothing_leaves_local_gradients(hooks):
    for rank, seen in enumerate(hooks):
        assert seen["noop_gap_to_other_rank"] > 1e-3, f"rank {rank}: gradients were synchronised"


def test_bucket_is_not_predivided_by_world_size(hooks):
    for rank, seen in enumerate(hooks):
        assert seen["sum_ratio"] == pytest.approx([2.0] * 4, rel=1e-4), f"rank {rank}"


def test_fp16_compress_hook_divides_before_the_allreduce(hooks):
    for rank, seen in enumerate(hooks):
        assert seen["fp16_hook_grad"] == 40000.0, f"rank {rank}"        # (40000/2 + 40000/2)
        assert seen["fp16_hook_dtype"] == "torch.float32", f"rank {rank}"  # decompressed in place
        assert seen["naive_fp16_grad"] == float("inf"), f"rank {rank}"  # 80000 > 65504
        assert 0 < seen["fp16_relative_gap"] < 2e-3, f"rank {rank}: float16 rounding only"


def test_bf16_compress_hook_is_refused_without_cuda_and_nccl(hooks):
    if torch.cuda.is_available():
        pytest.skip("shows the CPU-only behaviour")
    for seen in hooks:
        assert seen["bf16_register"].startswith("TypeError")
        assert "NCCL" in seen["bf16_register"]


def test_hook_registers_once(hooks):
    for seen in hooks:
        assert seen["second_register"].startswith("RuntimeError")


def test_hook_returning_a_tensor_fails_in_backward(hooks):
    for seen in hooks:
        assert seen["tensor_hook"].startswith("RuntimeError")
        assert "Future" in seen["tensor_hook"] or "must re" in seen["tensor_hook"]


def test_a_bucket_never_mixes_dtypes(hooks):
    for rank, seen in enumerate(hooks):
        for buckets in seen["mixed_dtype_buckets"]:       # the first backward and the second
            assert sorted(b["dtype"] for b in buckets) == ["torch.float32", "torch.float64"], f"rank {rank}"
            assert all(b["param_dtypes"] == [b["dtype"]] for b in buckets), f"rank {rank}"
        assert seen["mixed_grad_dtypes"] == ["torch.float32", "torch.float64"]  # nothing was cast


def test_grad_bucket_api(hooks):
    buckets = hooks[0]["buckets_per_iteration"][1]
    assert [b["index"] for b in buckets] == list(range(len(buckets))) and len(buckets) >= 2
    assert [b["is_last"] for b in buckets] == [False] * (len(buckets) - 1) + [True]
    assert all(b["dtype"] == "torch.float32" for b in buckets)
    assert all(b["numel"] == b["param_numel"] for b in buckets)
    assert all(b["grads_match"] for b in buckets)
    # Bucket 0 holds the last layer: buckets follow the order gradients become ready.
    assert set(buckets[0]["params"]) == {"2.weight", "2.bias"}
    assert set(buckets[-1]["params"]) == {"0.weight", "0.bias"}


def test_powersgd_starts_with_exact_allreduce_then_compresses(hooks):
    for rank, seen in enumerate(hooks):
        steps = seen["powersgd"]
        assert steps[0]["weight_gap"] < 1e-6 and steps[1]["weight_gap"] < 1e-6, f"rank {rank}"
        assert steps[2]["weight_gap"] > 1e-3, f"rank {rank}: step 2 should be rank-1 approximated"
        assert all(s["bias_gap"] < 1e-5 for s in steps), f"rank {rank}: biases are not compressed"
        assert all(s["gap_to_other_rank"] < 1e-6 for s in steps), f"rank {rank}: replicas diverged"


def test_powersgd_error_feedback_keeps_a_buffer_per_bucket(hooks):
    for seen in hooks:
        assert seen["powersgd_error_numels"] == [seen["bucket_numel"]]
