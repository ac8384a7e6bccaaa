"""Topic internals: buckets and their order, overlap with backward, unused parameters, gradient
views, the buffer-sync rule and communication hooks (two gloo ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quiz_demos.world import run_world


def stack(n: int = 4) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])


def buckets_and_overlap(ctx, DDP) -> dict:
    """One bucket per layer (a tiny cap): which layers each bucket holds, and when each bucket's
    hook runs compared with the gradient of the first layer."""
    model = stack()
    names = {id(p): name for name, p in model.named_parameters()}
    events: list[str] = []
    ddp = DDP(model, bucket_cap_mb=0.0002)  # 200 bytes: each layer's 8x8 weight gets its own bucket
    model[0].weight.register_hook(lambda g: events.append("grad 0.weight"))

    def hook(state, bucket):
        events.append(f"bucket {bucket.index()}: " + ",".join(sorted(names[id(p)] for p in bucket.parameters())))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())  # no communication needed for this observation
        return fut

    ddp.register_comm_hook(None, hook)
    iterations = []
    for _ in range(2):
        events.clear()
        ddp(torch.randn(2, 8)).sum().backward()
        iterations.append(list(events))
    return {"iterations": iterations, "cap_default": DDP(stack(1)).bucket_bytes_cap}


def unused_parameters(ctx, DDP) -> dict:
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.used(self.body(x))

    out = {}
    ddp = DDP(TwoHeads())
    ddp(torch.randn(2, 4)).sum().backward()
    out["first_backward"] = "finished"
    try:
        ddp(torch.randn(2, 4))
        out["second_forward"] = "finished"
    except RuntimeError as exc:
        out["second_forward"] = str(exc)
    found = DDP(TwoHeads(), find_unused_parameters=True)
    for _ in range(2):
        found(torch.randn(2, 4)).sum().backward()
    out["with_find_unused"] = "finished"
    out["unused_grad"] = found.module.unused.weight.grad is None
    return out


def bucket_view(ctx, DDP) -> dict:
    out = {}
    for view in (False, True):
        model = stack(2)
        ddp = DDP(model, gradient_as_bucket_view=view)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(2):  # views take effect after the first iteration
            opt.zero_grad(set_to_none=False)
            ddp(torch.randn(2, 8)).sum().backward()
            opt.step()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        out[f"grad_storages_view_{view}"] = len(storages)
        out[f"params_{view}"] = len(list(model.parameters()))
    return out


def buffer_rule(ctx, DDP) -> dict:
    """Rank 1 overwrites its running mean; which forwards bring rank 0's back?"""
    bn = nn.BatchNorm1d(2).eval()  # eval: forward does not update the running stats itself
    ddp = DDP(nn.Sequential(nn.Linear(2, 2), bn))
    x = torch.randn(4, 2)
    seen = {}

    def spoil():
        with torch.no_grad():
            if ctx.rank == 1:
                bn.running_mean.fill_(7.0)

    ddp(x)  # a forward with grad enabled: the next forward syncs
    spoil()
    ddp(x)
    seen["after_grad_forward"] = bn.running_mean.clone()
    with torch.no_grad():
        ddp(x)  # under no_grad: the next forward does not sync
    spoil()
    ddp(x)
    seen["after_no_grad_forward"] = bn.running_mean.clone()
    ddp(x)
    seen["one_forward_later"] = bn.running_mean.clone()
    return seen


def fp16_hook(ctx, DDP) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    ddp = DDP(model)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    torch.manual_seed(10 + ctx.rank)
    x = torch.randn(4, 8)
    ddp(x).sum().backward()
    return {"grad": model.weight.grad.clone(), "grad_dtype": str(model.weight.grad.dtype),
            "param_dtype": str(model.weight.dtype), "x": x}


def internals_main(ctx) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    with ctx.group():
        return {
            "buckets": buckets_and_overlap(ctx, DDP),
            "unused": unused_parameters(ctx, DDP),
            "view": bucket_view(ctx, DDP),
            "buffers": buffer_rule(ctx, DDP),
            "fp16": fp16_hook(ctx, DDP),
        }


@pytest.fixture(scope="module")
def ranks(session):
    return run_world(session, "quiz_demos.test_internals:internals_main", 2)


@pytest.mark.slow
def test_first_iteration_uses_one_bucket_then_buckets_follow_the_gradient_order(ranks):
    first, second = ranks[0]["buckets"]["iterations"]
    # torch 2.13 (find_unused_parameters=False): every parameter in one bucket for the first
    # iteration; then the buckets are rebuilt in the order the gradients became ready.
    assert [e for e in first if e.startswith("bucket")] == [
        "bucket 0: " + ",".join(f"{i}.{k}" for i in range(4) for k in ("bias", "weight"))]
    assert [e for e in second if e.startswith("bucket")] == [
        f"bucket {b}: {3 - b}.bias,{3 - b}.weight" for b in range(4)]
    assert ranks[0]["buckets"]["cap_default"] == 25 * 1024 * 1024


@pytest.mark.slow
def test_a_bucket_is_handed_over_while_backward_is_still_running(ranks):
    first, second = ranks[0]["buckets"]["iterations"]
    assert second.index("bucket 0: 3.bias,3.weight") < second.index("grad 0.weight")
    assert first.index("grad 0.weight") < 1  # the single first-iteration bucket waits for every gradient


@pytest.mark.slow
def test_an_unused_parameter_fails_the_next_forward_unless_found(ranks):
    unused = ranks[0]["unused"]
    assert unused["first_backward"] == "finished"
    assert "Expected to have finished reduction in the prior iteration" in unused["second_forward"]
    assert "find_unused_parameters=True" in unused["second_forward"]
    assert unused["with_find_unused"] == "finished" and unused["unused_grad"] is True


@pytest.mark.slow
def test_gradient_as_bucket_view_puts_grads_in_the_bucket(ranks):
    view = ranks[0]["view"]
    assert view["grad_storages_view_False"] == view["params_False"]  # one storage per gradient
    assert view["grad_storages_view_True"] == 1  # every gradient is a view of the one bucket


@pytest.mark.slow
def test_buffers_are_broadcast_only_after_a_forward_with_grad(ranks):
    buffers = ranks[1]["buffers"]
    rank0 = ranks[0]["buffers"]["after_grad_forward"]
    assert torch.equal(buffers["after_grad_forward"], rank0)  # rank 1's 7s were overwritten
    assert torch.equal(buffers["after_no_grad_forward"], torch.full((2,), 7.0))  # not synced this time
    assert torch.equal(buffers["one_forward_later"], rank0)


@pytest.mark.slow
def test_fp16_compress_hook_averages_in_half_precision_and_leaves_fp32(ranks):
    for r in ranks:
        assert r["fp16"]["grad_dtype"] == r["fp16"]["param_dtype"] == "torch.float32"
    exact = (ranks[0]["fp16"]["x"].sum(0) + ranks[1]["fp16"]["x"].sum(0)) / 2
    grad = ranks[0]["fp16"]["grad"][0]
    torch.testing.assert_close(grad, exact, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(grad, exact.half().float(), atol=1e-2, rtol=0)
    assert torch.equal(ranks[0]["fp16"]["grad"], ranks[1]["fp16"]["grad"])
