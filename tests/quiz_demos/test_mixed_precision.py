"""Demonstrations for the quiz topic 'mixed-precision' (grader/quiz/bank/mixed-precision.toml).

Each test runs the behaviour a question states on the installed torch, so an upgrade that changes
it fails here instead of the quiz teaching something false.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from quiz_demos.world import run_world


def _scaled_step(model, opt, scaler, x):
    opt.zero_grad()
    loss = model(x).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


# --- autocast ---------------------------------------------------------------------------------------

def test_autocast_bf16_on_cpu_casts_matmul_outputs_not_parameters():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
        mse = nn.functional.mse_loss(y, torch.zeros(2, 4))
        ce = nn.functional.cross_entropy(y, torch.tensor([0, 1]))
    assert y.dtype == torch.bfloat16            # linear runs in the lower precision
    assert mse.dtype == torch.float32           # losses are on autocast's float32 list
    assert ce.dtype == torch.float32
    assert lin.weight.dtype == torch.float32    # the parameters are not converted
    ce.backward()
    assert lin.weight.grad.dtype == torch.float32  # .grad has the parameter's dtype


def test_autocast_default_dtype_differs_between_cpu_and_cuda():
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert torch.get_autocast_dtype("cuda") == torch.float16


def test_fp16_and_bf16_range_and_precision():
    fp16, bf16, fp32 = torch.finfo(torch.float16), torch.finfo(torch.bfloat16), torch.finfo(torch.float32)
    assert fp16.max == 65504.0
    assert bf16.max > 3e38 and bf16.max / fp32.max > 0.99      # about float32's range
    assert bf16.eps == 2 ** -7 and fp16.eps == 2 ** -10         # 8 vs 11 significant bits
    assert torch.tensor(70000.0).half().isinf()                 # overflows float16
    assert torch.tensor(70000.0).bfloat16().isfinite()
    assert torch.tensor(1e-8).half().item() == 0.0              # underflows float16
    assert torch.tensor(1e-8).bfloat16().item() > 0.0


# --- GradScaler --------------------------------------------------------------------------------------

def test_grad_scaler_skips_the_step_and_halves_the_scale_on_inf():
    torch.manual_seed(0)
    lin = nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = lin.weight.detach().clone()
    _scaled_step(lin, opt, scaler, torch.tensor([[float("inf"), 1.0]]))
    assert torch.equal(lin.weight, before)      # optimizer.step() was skipped
    assert scaler.get_scale() == 512.0          # scale * backoff_factor (0.5)
    _scaled_step(lin, opt, scaler, torch.ones(1, 2))
    assert not torch.equal(lin.weight, before)  # a finite step goes through


def test_grad_scaler_grows_after_growth_interval_clean_steps():
    lin = nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    scales = []
    for _ in range(4):
        _scaled_step(lin, opt, scaler, torch.ones(1, 2))
        scales.append(scaler.get_scale())
    assert scales == [8.0, 8.0, 16.0, 16.0]     # x growth_factor (2) after 3 clean steps
    assert GradScaler_defaults() == (2.0 ** 16, 2.0, 0.5, 2000)


def GradScaler_defaults():
    s = torch.amp.GradScaler("cpu")
    return s.get_scale() if s._scale is not None else s._init_scale, s.get_growth_factor(), \
        s.get_backoff_factor(), s.get_growth_interval()


def test_unscale_before_clipping_gives_the_true_gradient_norm():
    torch.manual_seed(0)
    lin = nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.ones(1, 3)
    lin(x).sum().backward()
    true_norm = lin.weight.grad.norm().item()
    opt.zero_grad()
    scaler.scale(lin(x).sum()).backward()
    assert lin.weight.grad.norm().item() == pytest.approx(1024.0 * true_norm)  # still scaled
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(lin.parameters(), max_norm=1e9)
    assert norm.item() == pytest.approx(true_norm)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)                    # once per optimizer per step
    scaler.step(opt)                            # step does not unscale a second time
    scaler.update()


def test_grad_scaler_state_dict_holds_the_scale_and_growth_tracker():
    lin = nn.Linear(2, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    _scaled_step(lin, opt, scaler, torch.tensor([[float("inf"), 1.0]]))
    _scaled_step(lin, opt, scaler, torch.ones(1, 2))
    state = scaler.state_dict()
    assert state["scale"] == 128.0 and state["_growth_tracker"] == 1
    resumed = torch.amp.GradScaler("cpu")
    resumed.load_state_dict(state)
    assert resumed.get_scale() == 128.0 and resumed._get_growth_tracker() == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows the behaviour on a machine without CUDA")
def test_cuda_grad_scaler_without_cuda_disables_itself():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = torch.amp.GradScaler()         # device defaults to "cuda"
    assert not scaler.is_enabled()
    assert any("Disabling" in str(w.message) for w in caught)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss           # no scaling at all


# --- GradScaler under DDP: an inf on one rank -----------------------------------------------------

def mixed_precision_main(ctx) -> dict:
    with ctx.group():
        return ddp_scaler_observations(ctx.rank)


def ddp_scaler_observations(rank: int) -> dict:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = model.module.weight.detach().clone()
    # Only rank 0 sees a bad sample; rank 1's own gradients are finite.
    x = torch.tensor([[float("inf"), 1.0]]) if rank == 0 else torch.ones(1, 2)
    opt.zero_grad()
    scaler.scale(model(x).sum()).backward()
    grad_finite = bool(model.module.weight.grad.isfinite().all())
    scaler.step(opt)
    scaler.update()

    # Under autocast the gradients DDP reduces still have the parameters' dtype.
    seen_dtypes = []

    def recording_hook(state, bucket):
        seen_dtypes.append(str(bucket.buffer().dtype))
        return default_hooks.allreduce_hook(None, bucket)

    lowp = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
    lowp.register_comm_hook(None, recording_hook)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lowp(torch.randn(2, 8))
    out.float().sum().backward()
    return {"grad_finite_after_backward": grad_finite,
            "stepped": not torch.equal(model.module.weight, before),
            "scale": scaler.get_scale(),
            "autocast_output_dtype": str(out.dtype),
            "bucket_dtypes_under_autocast": seen_dtypes,
            "grad_dtype_under_autocast": str(lowp.module.weight.grad.dtype)}


@pytest.fixture(scope="module")
def ddp_scaler(session):
    return run_world(session, "quiz_demos.test_mixed_precision:mixed_precision_main", 2)


@pytest.mark.slow
def test_ddp_inf_on_one_rank_makes_every_rank_skip(ddp_scaler):
    for rank, seen in enumerate(ddp_scaler):
        assert not seen["grad_finite_after_backward"], f"rank {rank}: all-reduce spread the inf"
        assert not seen["stepped"], f"rank {rank} stepped"
        assert seen["scale"] == 512.0, f"rank {rank} scale {seen['scale']}"


@pytest.mark.slow
def test_ddp_reduces_float32_gradients_under_autocast(ddp_scaler):
    for rank, seen in enumerate(ddp_scaler):
        assert seen["autocast_output_dtype"] == "torch.bfloat16", f"rank {rank}"
        assert seen["bucket_dtypes_under_autocast"] == ["torch.float32"], f"rank {rank}"
        assert seen["grad_dtype_under_autocast"] == "torch.float32", f"rank {rank}"


def test_no_process_group_left_behind():
    assert not dist.is_initialized()
