"""Exercise 35, grader side: the recipe computed in this process. The float8 casts of every tensor a call
multiplies, done as torchao does them; the layer's output and gradients from those casts in float64 (the
products of float8 values and float32 scales, summed exactly), with how far float32's sums may stray from
them; the same twenty steps in float32; and the whole weight each group all-gathers, cast."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from grader.rank.drivers.ex35_float8 import (E4M3, E5M2, EPS, GATHER_ROWS, LAYER_OF, STEPS, adamw_step,
                                            call_inputs, gather_weight, loss_fn, make_linear, make_mlp,
                                            plant_weight_outlier, training_data)

FORMATS = {"input": E4M3, "weight": E4M3, "grad": E5M2}
UNIT = 2.0 ** -24  # float32's unit roundoff


def scale_of(t: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """torchao's amax_to_scale: float32(max / max(amax, eps)), the division in float64."""
    amax = t.detach().abs().max().float()
    return (torch.finfo(float8_dtype).max / torch.clamp(amax.double(), min=EPS)).float()


def to_float8(t: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """torchao's cast: t * scale in float32, saturated, rounded to the nearest float8 (ties to even)."""
    largest = torch.finfo(float8_dtype).max
    return (t.detach().float() * scale).clamp(-largest, largest).to(float8_dtype)


def cast(t: torch.Tensor, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = scale_of(t, float8_dtype)
    return to_float8(t, scale, float8_dtype), scale


def borderline(t: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, slack: float = 2.0 ** -20) -> int:
    """How many values of t * scale lie within ``slack`` (relative) of a float8 rounding boundary: there, ways of
    computing t * scale that round differently in float32 (in float64, or t / (1 / scale)) may cast apart."""
    exact = t.detach().double() * scale.double()
    low = exact * (1 - slack)
    high = exact * (1 + slack)
    largest = torch.finfo(float8_dtype).max
    return int((low.clamp(-largest, largest).to(float8_dtype) != high.clamp(-largest, largest).to(float8_dtype))
               .sum())


def call_tensors(call: str) -> dict[str, torch.Tensor | None]:
    """What a call multiplies, as a right layer sees it: x [ROWS, IN], the weight [OUT, IN] (with the outlier
    planted before the second call), the output's gradient [ROWS, OUT], the bias [OUT] or None."""
    linear = make_linear(LAYER_OF[call])
    if call == "outlier":
        plant_weight_outlier(linear.weight)
    x, grad = call_inputs(call)
    return {"input": x.reshape(-1, x.shape[-1]), "weight": linear.weight.detach().clone(),
            "grad": grad.reshape(-1, grad.shape[-1]),
            "bias": linear.bias.detach().clone() if linear.bias is not None else None, "shape": tuple(x.shape)}


def _dequantized(t8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t8 times the reciprocal scale _scaled_mm is given (float32's reciprocal), in float64."""
    return t8.double() * scale.reciprocal().double()


def _product(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, float]:
    """a @ b in float64, and how far float32 may stray from it: its sums (inner dimension k), each operand's
    product with its scale, a bias added after."""
    value = a @ b
    magnitude = float((a.abs() @ b.abs()).max()) if value.numel() else 0.0
    k = a.shape[-1]
    return value, 2 * (k + 4) * UNIT * magnitude


@functools.cache
def expected_call(call: str) -> dict:
    """The recipe for one call: each operand cast (torchao's way), the output and the gradients from them."""
    t = call_tensors(call)
    out = {"tensors": t}
    for role, float8_dtype in FORMATS.items():
        out[role] = cast(t[role], float8_dtype)  # (t8, scale)
    x, w, g = (_dequantized(*out[role]) for role in ("input", "weight", "grad"))
    output, output_tol = _product(x, w.t())
    if t["bias"] is not None:
        output = output + t["bias"].double()
        output_tol += 2 * UNIT * float(output.abs().max())
    grad_input, grad_input_tol = _product(g, w)
    grad_weight, grad_weight_tol = _product(g.t(), x)
    rows = t["grad"].shape[0]
    grad_bias = t["grad"].double().sum(0) if t["bias"] is not None else None
    grad_bias_tol = 2 * (rows + 2) * UNIT * float(t["grad"].abs().sum(0).max())
    shape = t["shape"]
    out.update(output=(output.reshape(*shape[:-1], -1), output_tol),
               grads={"input": (grad_input.reshape(shape), grad_input_tol),
                      "weight": (grad_weight, grad_weight_tol),
                      "bias": (grad_bias, grad_bias_tol) if grad_bias is not None else None})
    return out


# --- what wrong recipes give (the verdicts name a wrong value that equals one) ----------------------


def cast_candidates(t: torch.Tensor, float8_dtype: torch.dtype, role: str, call: str) -> list:
    """(key, t8) of the casts of ``t`` that common mistakes make, in the order they are tried."""
    largest = torch.finfo(float8_dtype).max
    scale = float(scale_of(t, float8_dtype))
    other = E5M2 if float8_dtype == E4M3 else E4M3
    scales = [("unscaled", 1.0)]
    if float(t.max()) > 0:
        scales.append(("max-without-abs", largest / max(float(t.max()), EPS)))
    if 0 < scale < float("inf"):
        scales.append(("power-of-two", 2.0 ** math.floor(math.log2(scale))))
    scales.append(("other-format", torch.finfo(other).max / max(float(t.abs().max()), EPS)))
    out = []
    if call == "outlier":
        before = call_tensors("plain")[role]
        if role == "weight":
            out.append(("previous-weight", cast(before, float8_dtype)[0]))
        scales.append(("previous-scale", float(scale_of(before, float8_dtype))))
    out += [(key, to_float8(t, torch.tensor(s, dtype=torch.float32), float8_dtype)) for key, s in scales]
    return out


def float32_products(call: str) -> dict[str, torch.Tensor]:
    """The output and gradients of the call with no float8 at all (float64 products of the float32 tensors)."""
    t = call_tensors(call)
    x, w, g = (t[role].double() for role in ("input", "weight", "grad"))
    output = x @ w.t() + (t["bias"].double() if t["bias"] is not None else 0)
    return {"output": output.reshape(*t["shape"][:-1], -1), "input": (g @ w).reshape(t["shape"]), "weight": g.t() @ x}


# --- training ------------------------------------------------------------------------------------


def _mlp_loss(model: nn.Module) -> float:
    x, target = training_data()
    with torch.no_grad():
        return float(loss_fn(model(x), target))


@functools.cache
def training_reference() -> dict:
    """The same STEPS steps in float32: the loss before each step, and the loss of the final weights."""
    model = make_mlp()
    x, target = training_data()
    params, state, losses = list(model.parameters()), [], []
    for step in range(1, STEPS + 1):
        for p in params:
            p.grad = None
        loss = loss_fn(model(x), target)
        loss.backward()
        losses.append(float(loss.detach()))
        adamw_step(params, state, step)
    return {"losses": losses, "final_loss": _mlp_loss(model),
            "params": [(name, tuple(p.shape)) for name, p in model.named_parameters()]}


def ordered_weights(params) -> list | None:
    """The MLP's parameters in the float32 model's order: by name, or in the layer's own order when it names them
    otherwise (a wrapper's "0.linear.weight"); None unless each is a finite tensor of the right shape."""
    if not isinstance(params, dict) or not all(isinstance(n, str) and isinstance(p, torch.Tensor)
                                               for n, p in params.items()):
        return None
    wanted = training_reference()["params"]
    names = [name for name, _ in wanted]
    ordered = [params[n] for n in names] if sorted(params) == sorted(names) else list(params.values())
    if len(ordered) != len(wanted) or any(tuple(p.shape) != shape or not torch.isfinite(p.double()).all()
                                          for p, (_, shape) in zip(ordered, wanted)):
        return None
    return ordered


def loss_of(weights: list[torch.Tensor]) -> float:
    """The float32 MLP's loss with ``weights`` (in parameters() order, shapes already checked) in it."""
    model = make_mlp()
    with torch.no_grad():
        for p, value in zip(model.parameters(), weights):
            p.copy_(value.float())
    return _mlp_loss(model)


# --- the all-gather ------------------------------------------------------------------------------


@functools.cache
def gather_expected(scenario: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole weight a group of ``size`` gathers, cast to E4M3 with the scale of its global amax."""
    return cast(gather_weight(scenario, size), E4M3)


def own_shard_casts(scenario: str, size: int) -> list[tuple[int, torch.Tensor, float]]:
    """(rank in the group, its shard cast with the shard's own amax, that amax) for every shard whose own scale is
    not the whole weight's."""
    whole = gather_weight(scenario, size)
    out = []
    for q in range(size):
        shard = whole[q * GATHER_ROWS:(q + 1) * GATHER_ROWS]
        if float(scale_of(shard, E4M3)) != float(scale_of(whole, E4M3)):
            out.append((q, cast(shard, E4M3)[0], float(shard.abs().max())))
    return out


def signed_amax_cast(scenario: str, size: int) -> tuple[torch.Tensor, float] | None:
    """The whole weight a group of ``size`` gathers cast with the scale of its largest value instead of its largest
    magnitude (an amax taken without abs), and that value; None where the two agree."""
    whole = gather_weight(scenario, size)
    signed = whole.max()
    if float(signed) == float(whole.abs().max()):
        return None
    scale = (torch.finfo(E4M3).max / torch.clamp(signed.double(), min=EPS)).float()
    return to_float8(whole, scale, E4M3), float(signed)
