"""Exercise 08: BucketedDDP, bucketed all-reduces that overlap backward.

Rank side: build a small model whose parameters and buffer differ on every rank
(seeded by rank), with one frozen layer in the middle; wrap it in the learner's
BucketedDDP with several caps to read the buckets, then train a few steps while
recording, in order, every torch.distributed call (with its async_op flag), the
moment the first layer's gradient is ready and the end of loss.backward().
All of it three times: the model in float32, in float64, and with one layer in
float64 among float32 ones (so a bucket holds both), since bucket sizes and the
precision of the average depend on each parameter's dtype.
Grader side: rebuild rank 0's model and every rank's data, compute the averaged
gradients and the parameters after each step itself, and compare.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.rank import probes
from grader.compare import tensor_difference
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.drivers.ex08_bucketed import (FIRST_LAYER, LAYOUT_CAPS_BYTES, LAYOUT_PLANS, LR, MIB, Net, PLANS, STEPS,
                                               TRAIN_CAP_BYTES, _state, bucket_main, build_model, forward_kwargs,
                                               make_batch, training)


GRAD_TOL = {  # (rtol, atol): the sum over ranks may be taken in another order, nothing more
    torch.float32: (1e-5, 1e-6),
    torch.float64: (1e-10, 1e-12),  # an average taken in float32 is off by about 1e-8
}


def expected_buckets(cap_bytes: float, plan: str = "float32") -> list[list[str]]:
    """The buckets the contract implies, by parameter name."""
    model = build_model(0, plan)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    buckets, bucket, size = [], [], 0
    for name, param in reversed(trainable):
        nbytes = param.numel() * param.element_size()
        if bucket and size + nbytes > cap_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(name)
        size += nbytes
    if bucket:
        buckets.append(bucket)
    return buckets


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        outcome = g.run(bucket_main, world_size)
        timelines.keep(g, outcome, f"world size {world_size}", draw=(training("float32"),))
        results = outcome.results()
        for plan in PLANS:
            observations = [r[plan] for r in results]
            if plan in LAYOUT_PLANS:
                check_buckets(g, observations, world_size, plan)
            check_broadcast(g, observations, world_size, plan)
            check_steps(g, observations, world_size, plan)
    if max(g.world_sizes) == 1:  # one GPU with NCCL: nothing to compare across ranks
        for check_id in ("broadcast-from-rank0", "params-identical"):
            g.skip(check_id, "needs a world size of 2 or more")


def _model_text(plan: str) -> str:
    return {"float32": "", "float64": "the float64 model, ", "mixed": "the model with fc2 in float64, "}[plan]


def check_buckets(g, observations: list[dict], world_size: int, plan: str = "float32") -> None:
    for cap_bytes, *per_rank in zip(LAYOUT_CAPS_BYTES, *(o["layouts"] for o in observations)):
        expected = expected_buckets(cap_bytes, plan)
        for rank, got in enumerate(per_rank):
            if got != expected:
                g.record("buckets-by-cap", False,
                         f"{_model_text(plan)}rank {rank}, bucket_cap_mb={cap_bytes / MIB:.10g} ({cap_bytes:g} "
                         f"bytes): .buckets is {_show(got)}; expected {_show(expected)} (parameter sizes in "
                         f"bytes: {_sizes(plan)})", rank=rank, world_size=world_size)
                return
    g.record("buckets-by-cap", True)


def _show(buckets: list[list[str]]) -> str:
    return "[" + ", ".join("[" + ", ".join(b) + "]" for b in buckets) + "]"


def _sizes(plan: str = "float32") -> str:
    return ", ".join(f"{n} {p.numel() * p.element_size()}" for n, p in build_model(0, plan).named_parameters()
                     if p.requires_grad)


def check_broadcast(g, observations: list[dict], world_size: int, plan: str = "float32") -> None:
    reference = _state(build_model(0, plan))
    frozen = {n for n, p in Net().named_parameters() if not p.requires_grad}
    broadcast_ok = frozen_ok = True
    for rank, obs in enumerate(observations):
        for name, expected in reference.items():
            got = obs["after_init"][name]
            if torch.equal(got, expected):
                continue
            what = "frozen parameter" if name in frozen else ("buffer" if name == "scale" else "parameter")
            message = (f"{_model_text(plan)}rank {rank}: after BucketedDDP(...) the {what} {name} is not rank 0's "
                       f"(largest difference {_max_diff(got, expected)})")
            if name in frozen and frozen_ok:
                frozen_ok = g.record("frozen-untouched", False, message + "; frozen parameters are broadcast too",
                                     rank=rank, world_size=world_size)
            elif name not in frozen and broadcast_ok:
                broadcast_ok = g.record("broadcast-from-rank0", False, message, rank=rank, world_size=world_size)
    g.record("broadcast-from-rank0", True)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    found = tensor_difference(a, b)
    if found is None:
        return "0"
    if found.reason == "shape":
        return f"shape {tuple(a.shape)} instead of {tuple(b.shape)}"
    return f"{found.max_abs:.3g}"


def reference_steps(world_size: int, plan: str = "float32") -> list[dict]:
    """Averaged gradients and parameters after each step, as DDP would give them, computed here."""
    model = build_model(0, plan)
    out = []
    for step in range(STEPS):
        local = []
        for rank in range(world_size):
            model.zero_grad()
            x, y = make_batch(step, rank)
            prediction = model(x, **forward_kwargs(step))
            F.mse_loss(prediction, y.to(prediction.dtype)).backward()
            local.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        grads = {n: torch.stack([g_[n] for g_ in local]).sum(0) / world_size for n in local[0]}
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in grads:
                    param -= LR * grads[name]
        out.append({"grads": grads, "state": _state(model)})
    return out


def averaged_gradients(state: dict, step: int, world_size: int, plan: str) -> dict:
    """The average over ranks of the gradients at ``state`` (a rank's parameters and buffers before ``step``).

    Taken from the rank's own parameters rather than from the replay, so that a
    float32 parameter one rounding away from the replay's (an average taken in
    float64, then stored in float32, is as right as one taken in float32) cannot
    move a float64 gradient by more than its own tolerance.
    """
    model = build_model(0, plan)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            tensor.copy_(state[name])
    local = []
    for rank in range(world_size):
        model.zero_grad()
        x, y = make_batch(step, rank)
        prediction = model(x, **forward_kwargs(step))
        F.mse_loss(prediction, y.to(prediction.dtype)).backward()
        local.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return {n: torch.stack([g_[n] for g_ in local]).sum(0) / world_size for n in local[0]}


def check_steps(g, observations: list[dict], world_size: int, plan: str = "float32") -> None:
    reference = reference_steps(world_size, plan)
    trainable = [n for n, p in Net().named_parameters() if p.requires_grad]
    frozen = [n for n, p in Net().named_parameters() if not p.requires_grad]
    # The mixed model's buckets are the learner's own (they may be split by dtype): one all-reduce each.
    bucket_count = len(expected_buckets(TRAIN_CAP_BYTES, plan)) if plan in LAYOUT_PLANS else None
    model_text = _model_text(plan)
    for step, ref in enumerate(reference):
        for rank, obs in enumerate(observations):
            got = obs["steps"][step]
            before = obs["steps"][step - 1]["state"] if step else obs["after_init"]
            averaged = averaged_gradients(before, step, world_size, plan)
            # the averaged gradients
            for name in trainable:
                grad = got["grads"][name]
                if grad is None:
                    g.record("grads-match-ddp", False, f"{model_text}step {step + 1}, rank {rank}: {name}.grad is "
                             "None after finish_gradient_synchronization()", rank=rank, world_size=world_size)
                    break
                want = averaged[name]
                if grad.dtype != want.dtype:
                    g.record("grads-match-ddp", False, f"{model_text}step {step + 1}, rank {rank}: {name}.grad is "
                             f"{_dtype(grad)}, the parameter is {_dtype(want)}", rank=rank, world_size=world_size)
                    break
                rtol, atol = GRAD_TOL[want.dtype]
                found = tensor_difference(grad, want, rtol=rtol, atol=atol)
                if found is not None:
                    ratio = _ratio(grad.double(), want.double())
                    if not ratio and want.dtype == torch.float64:
                        ratio = " (as much as float32 rounding: was this float64 gradient averaged in float32?)"
                    g.record("grads-match-ddp", False,
                             f"{model_text}step {step + 1}, rank {rank}: {name}.grad differs from the average over "
                             f"ranks by up to {found.max_abs:.3g}{ratio}", rank=rank, world_size=world_size)
                    break
            for name in trainable:
                found = tensor_difference(got["state"][name], ref["state"][name], atol=1e-5)
                diff = found.max_abs if found is not None else 0.0
                if diff > 1e-5:
                    g.record("grads-match-ddp", False, f"{model_text}after step {step + 1}, rank {rank}: parameter "
                             f"{name} differs from DDP's by {diff:.3g}", rank=rank, world_size=world_size)
                    break
            # frozen parameters: no gradient, no change
            for name in frozen:
                if got["grads"][name] is not None:
                    g.record("frozen-untouched", False, f"{model_text}step {step + 1}, rank {rank}: the frozen "
                             f"parameter {name} has a .grad; it must never be bucketed or all-reduced",
                             rank=rank, world_size=world_size)
                elif not torch.equal(got["state"][name], ref["state"][name]):
                    g.record("frozen-untouched", False, f"{model_text}after step {step + 1}, rank {rank}: the "
                             "frozen parameter "
                             f"{name} changed (by up to {_max_diff(got['state'][name], ref['state'][name])})",
                             rank=rank, world_size=world_size)
            count = obs["train_buckets"] if bucket_count is None else bucket_count
            check_events(g, got["events"], count, step, rank, world_size, model_text)
        # the replicas stay identical
        base = observations[0]["steps"][step]["state"]
        for rank, obs in enumerate(observations[1:], start=1):
            for name, tensor in obs["steps"][step]["state"].items():
                if not torch.equal(tensor, base[name]):
                    g.record("params-identical", False,
                             f"{model_text}after step {step + 1}, {name} on rank {rank} differs from rank 0's by "
                             f"{_max_diff(tensor, base[name])}", rank=rank, world_size=world_size)
                    break
    for check_id in ("grads-match-ddp", "params-identical", "frozen-untouched", "one-allreduce-per-bucket",
                     "async-overlap"):
        g.record(check_id, True)


def _ratio(got: torch.Tensor, expected: torch.Tensor) -> str:
    """Name a scale error (sum instead of mean) when the gradient is a multiple of the right one."""
    denom = expected.abs().sum().item()
    if denom == 0:
        return ""
    factor = (got * expected.sign()).sum().item() / denom
    if abs(factor - round(factor)) < 1e-3 and round(factor) not in (0, 1):
        return f" (it is {round(factor)} x the average: summed but not divided by the world size?)"
    return ""


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def check_events(g, events: list[dict], buckets: int, step: int, rank: int, world_size: int,
                 model_text: str = "") -> None:
    where = f"{model_text}step {step + 1}, rank {rank}"
    reduces = [i for i, e in enumerate(events) if e["op"] == "all_reduce"]
    others = sorted({e["op"] for e in events if e["op"] in probes.COLLECTIVES and e["op"] != "all_reduce"})
    if len(reduces) != buckets or others:
        extra = f", and also called {', '.join(others)}" if others else ""
        g.record("one-allreduce-per-bucket", False,
                 f"{where}: {len(reduces)} all_reduce call(s) during forward, backward and "
                 f"finish_gradient_synchronization{extra}; the {buckets} buckets need one each",
                 rank=rank, world_size=world_size)
    if not reduces:
        return
    marks = {e["op"]: i for i, e in enumerate(events) if e["op"] in ("first-layer-grad-ready", "backward-returned")}
    backward_end = marks.get("backward-returned", len(events))
    first_ready = marks.get("first-layer-grad-ready", backward_end)
    problems = []
    sync = [i for i in reduces if not events[i]["async_op"]]
    if sync:
        problems.append(f"{len(sync)} of {len(reduces)} all_reduce call(s) ran with async_op=False, so each "
                        "blocked until the network was done")
    if reduces[0] > first_ready:
        when = "after loss.backward() had returned" if reduces[0] > backward_end \
            else f"only after backward had reached the first layer ({FIRST_LAYER})"
        problems.append(f"the first all_reduce was issued {when}: nothing overlapped the backward pass")
    if problems:
        g.record("async-overlap", False, f"{where}: " + "; ".join(problems), rank=rank, world_size=world_size)
