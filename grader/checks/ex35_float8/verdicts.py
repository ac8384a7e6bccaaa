"""Exercise 35's verdicts: pure functions of what the ranks recorded (tests/test_ex35_float8.py feeds them
hand-made records). Every value a rank sent is read as untrusted: a tensor is compared only after its type and
shape are checked, an event only after its fields are."""

from __future__ import annotations

import math

import torch

from grader.rank.drivers.ex35_float8 import (CALLS, E4M3, E5M2, GATHER_COLS, GATHER_OUTLIER, GATHER_ROWS,
                                            GATHER_SCENARIOS, IN, LAYER_OF, OUT, ROWS, SCALED_MM, STEPS,
                                            gather_weight, groups_of, make_linear)
from grader.checks.ex35_float8.reference import (FORMATS, cast, cast_candidates, expected_call, float32_products,
                                                 gather_expected, loss_of, ordered_weights, own_shard_casts,
                                                 signed_amax_cast, training_reference)
from grader.compare import tensor_difference

CANONICAL = {"input": (ROWS, IN), "weight": (OUT, IN), "grad": (ROWS, OUT)}
CALL_WORDS = {"plain": "a layer's first call", "outlier": "its second call: the weight changed, an outlier in each",
              "zero-weight": "a layer initialised to zero", "no-bias": "a layer without bias"}
ROLE_WORDS = {"input": "input x", "weight": "weight", "grad": "output's gradient"}
PRODUCTS = {"forward": [frozenset({"input", "weight"})],
            "backward": [frozenset({"grad", "weight"}), frozenset({"grad", "input"})]}
PRODUCT_WORDS = {frozenset({"input", "weight"}): "the output (x8 @ w8^T)",
                 frozenset({"grad", "weight"}): "the input's gradient (go8 @ w8)",
                 frozenset({"grad", "input"}): "the weight's gradient (go8^T @ x8)"}
CAST_WORDS = {
    "unscaled": "it equals the tensor cast as it is, unscaled",
    "max-without-abs": ("it equals a cast with a scale from t.max(), the largest value, where the amax is the largest "
                        "magnitude (t.abs().max()): the outlier is negative"),
    "power-of-two": ("it equals a cast with the scale rounded down to a power of two (torchao's "
                     "round_scales_to_power_of_2, not its tensorwise default)"),
    "other-format": "it equals a cast with the scale of the other float8 format's largest value",
    "previous-scale": ("it equals a cast with the scale of the previous call's {role}: a scale kept from an earlier "
                       "call (delayed scaling)"),
    "previous-weight": ("it is the weight of the previous call, cast then: the float8 weight was kept from an earlier "
                        "call, but the weight changed since (an optimizer step changes it every step)"),
}
SCALE_RTOL = 1e-6  # a scale given to _scaled_mm against the recipe's reciprocal: float32 ways of computing it
GPU_LOOSER = 64  # a GPU's float8 product sums in its own order and precision
TRAINING_TOLERANCE = 1 / 8  # 2 x 2^-4: a product of two E4M3 casts, term by term (the statement derives it)
SMALL_BYTES = 16  # what a rank may send besides its shard: an amax or a few
GATHER_OPS = ("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
              "all_gather_into_tensor", "all_gather_into_tensor_coalesced")
ONE_BYTE = ("uint8", "int8", "float8_e4m3fn", "float8_e5m2")


def call_record(record, call: str) -> dict | None:
    calls = record.get("calls") if isinstance(record, dict) else None
    run = calls.get(call) if isinstance(calls, dict) else None
    return run if isinstance(run, dict) else None


def phase_events(run: dict, phase: str) -> list[dict]:
    found = run.get(phase) if isinstance(run.get(phase), list) else []
    return [e for e in found if isinstance(e, dict) and isinstance(e.get("op"), str)]


def _role(t) -> tuple[str, bool] | None:
    """Which tensor an operand is, from its shape (the three sizes differ), and whether it is transposed."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        return None
    for role, dims in CANONICAL.items():
        if tuple(t.shape) == dims:
            return role, False
        if tuple(t.shape) == dims[::-1]:
            return role, True
    return None


def operands(event: dict) -> list[tuple[str, torch.Tensor, object]]:
    """(role, the operand as the canonical [rows, cols] matrix, the scale it was given) of a _scaled_mm's
    operands whose role its shape tells."""
    out = []
    for key in ("a", "b"):
        found = _role(event.get(key))
        if found is not None:
            role, transposed = found
            t = event[key].t() if transposed else event[key]
            out.append((role, t.contiguous(), event.get(f"scale_{key}")))
    return out


def _where(call: str, phase: str) -> str:
    return f"call '{call}' ({CALL_WORDS[call]}), {phase}"


def raised_in(record) -> str | None:
    for call in CALLS:
        run = call_record(record, call)
        if run is None:
            return f"call '{call}' recorded nothing"
        if run.get("error"):
            return f"call '{call}' ({CALL_WORDS[call]}) raised {str(run['error'])[:600]}"
    return None


# --- the products ---------------------------------------------------------------------------------


def check_products(g, record) -> None:
    """Forward makes one _scaled_mm (the output), backward two (the input's and the weight's gradients), and
    nothing else multiplies."""
    problem = raised_in(record)
    if problem is None:
        problem = next((p for call in CALLS for p in [_products_problem(call_record(record, call), call)] if p), None)
    g.record("scaled-mm", problem is None, problem or "")


def _products_problem(run: dict, call: str) -> str | None:
    for phase, wanted in PRODUCTS.items():
        if phase == "backward" and not run.get("backward_ran"):
            return f"{_where(call, phase)}: backward did not run: the output is not a float32 tensor of the " \
                   "input's leading shape that requires grad"
        dispatched = phase_events(run, phase)
        other = [e for e in dispatched if e["op"] != SCALED_MM]
        if other:
            e = other[0]
            return (f"{_where(call, phase)}: a {e['op']} of {' x '.join(map(str, e.get('shapes') or []))} "
                    f"({', '.join(map(str, e.get('dtypes') or []))}): every product of the layer is a torch._scaled_mm "
                    "of float8 operands, nothing else multiplies")
        found = []
        for e in dispatched:
            roles = operands(e)
            if len(roles) != 2:
                shapes = [list(e[k].shape) if isinstance(e.get(k), torch.Tensor) else None for k in ("a", "b")]
                return (f"{_where(call, phase)}: a _scaled_mm of {shapes[0]} x {shapes[1]}: its operands should be "
                        f"two of x {list(CANONICAL['input'])}, the weight {list(CANONICAL['weight'])} and the "
                        f"output's gradient {list(CANONICAL['grad'])} (or their transposes)")
            found.append(frozenset(role for role, _, _ in roles))
        missing = [p for p in wanted if p not in found]
        extra = list(found)
        for p in wanted:
            if p in extra:
                extra.remove(p)
        if missing or extra:
            said = "; ".join(PRODUCT_WORDS.get(p, " x ".join(sorted(p))) for p in found) or "none"
            return (f"{_where(call, phase)}: {len(found)} _scaled_mm call(s) ({said}); {phase} makes "
                    + " and ".join(PRODUCT_WORDS[p] for p in wanted) + ", each once")
    return None


def _scaled_events(record) -> list[tuple[str, str, dict]]:
    """(call, phase, event) of every _scaled_mm with two recognisable operands, in order."""
    out = []
    for call in CALLS:
        run = call_record(record, call)
        for phase in PRODUCTS:
            for e in phase_events(run or {}, phase):
                if e["op"] == SCALED_MM and len(operands(e)) == 2:
                    out.append((call, phase, e))
    return out


def check_formats(g, record) -> None:
    for call, phase, e in _scaled_events(record):
        for role, t, _ in operands(e):
            want = str(FORMATS[role]).removeprefix("torch.")
            if t.dtype != FORMATS[role]:
                why = ("gradients span more orders of magnitude than activations: E5M2's range reaches 57344 and "
                       "down to 1.5e-5" if role == "grad" else "E4M3 keeps one more bit of mantissa")
                g.record("float8-formats", False, f"{_where(call, phase)}, {PRODUCT_WORDS[pair(e)]}: the "
                         f"{ROLE_WORDS[role]} entered as {str(t.dtype).removeprefix('torch.')}; the recipe casts it to "
                         f"{want} ({why})")
                return
            bad = ~torch.isfinite(t.float())
            if bad.any():
                index = [int(i) for i in bad.nonzero()[0]]
                g.record("float8-formats", False, f"{_where(call, phase)}: the {ROLE_WORDS[role]} holds "
                         f"{float(t.float()[tuple(index)])} at {index} ({int(bad.sum())} value(s) not finite): "
                         f"{_nonfinite_words(call, role)}")
                return
    g.record("float8-formats", True)


def pair(event: dict) -> frozenset:
    return frozenset(role for role, _, _ in operands(event))


def _nonfinite_words(call: str, role: str) -> str:
    if call == "zero-weight" and role == "weight":
        return "its amax is 0, so max / amax is inf and 0 * inf is NaN: clamp the amax to at least 1e-12 first"
    return "saturate: clamp t * scale to the format's +-max before the cast (E5M2 overflows to inf past 61440)"


def check_scales(g, record) -> None:
    """Each operand equals the recipe's cast of its tensor, byte for byte, and the scale it was given is the
    reciprocal of the recipe's (cast in its own format: a wrong format is float8-formats' to say)."""
    for call, phase, e in _scaled_events(record):
        tensors = expected_call(call)["tensors"]
        for role, got, given in operands(e):
            if got.dtype not in (E4M3, E5M2):
                continue
            want, scale = cast(tensors[role], got.dtype)
            where = f"{_where(call, phase)}, {PRODUCT_WORDS[pair(e)]}"
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                said = _cast_words(got, want, tensors[role], scale, role, call)
                g.record("scaled-from-amax", False, f"{where}: {said}")
                return
            problem = _scale_problem(given, scale)
            if problem is not None:
                g.record("scaled-from-amax", False, f"{where}: the scale given for the {ROLE_WORDS[role]} {problem}")
                return
    g.record("scaled-from-amax", True)


def _cast_words(got: torch.Tensor, want: torch.Tensor, t: torch.Tensor, scale: torch.Tensor, role: str,
                call: str) -> str:
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    index = [int(i) for i in differ.nonzero()[0]]
    at = tuple(index)
    top = [int(i) for i in torch.unravel_index(t.abs().argmax(), t.shape)]
    return (f"the {ROLE_WORDS[role]}'s float8 values differ from the recipe's cast in {int(differ.sum())} of "
            f"{got.numel()} places; first at {index}: {float(got.float()[at]):g} where {float(t[at]):.6g} x "
            f"{float(scale):.6g} rounds to {float(want.float()[at]):g}; the recipe's amax is "
            f"{float(t.abs().max()):.6g} (at {top} of the {' x '.join(map(str, t.shape))} matrix), scale = "
            f"{torch.finfo(got.dtype).max:g} / max(amax, 1e-12) = {float(scale):.8g}"
            + _explain_cast(got, t, role, call))


def _explain_cast(got: torch.Tensor, t: torch.Tensor, role: str, call: str) -> str:
    """What a wrong cast equals instead, when it equals something recognisable."""
    for key, value in cast_candidates(t, got.dtype, role, call):
        if torch.equal(value.view(torch.uint8), got.view(torch.uint8)):
            return "; " + CAST_WORDS[key].format(role=ROLE_WORDS[role])
    return ""


def _scale_problem(given, scale: torch.Tensor) -> str | None:
    if not isinstance(given, torch.Tensor) or given.numel() != 1:
        return f"is {_describe(given)}, not a one-element tensor"
    value, want = float(given.reshape(-1)[0]), float(scale.reciprocal())
    if math.isfinite(value) and abs(value - want) <= SCALE_RTOL * abs(want):
        return None
    said = f"is {value:.8g}; the recipe gives 1 / scale = {want:.8g}: _scaled_mm multiplies each operand by its scale"
    if math.isfinite(value) and abs(value - float(scale)) <= SCALE_RTOL * abs(float(scale)):
        return said + ", and this is the scale itself, not its reciprocal"
    if value == 1.0:
        return said + ", and 1 leaves the scaling in the result"
    return said


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return repr(value)[:80]


def check_gpu_ready(g, record) -> None:
    """What a GPU's _scaled_mm (cuBLASLt) accepts, though the CPU's accepts more."""
    for call, phase, e in _scaled_events(record):
        problem = _gpu_problem(e)
        if problem is not None:
            g.record("gpu-ready", False, f"{_where(call, phase)}, {PRODUCT_WORDS[pair(e)]}: {problem}")
            return
    g.record("gpu-ready", True)


def _gpu_problem(e: dict) -> str | None:
    a, b = e["a"], e["b"]
    a_stride, b_stride = e.get("a_stride"), e.get("b_stride")
    if not (isinstance(a_stride, list) and a_stride[-1:] == [1]):
        return (f"mat1 has strides {a_stride}: a GPU takes mat1 row-major (contiguous) and refuses the rest "
                "(\"Only multiplication of row-major and column-major matrices is supported by cuBLASLt\"): "
                "make it .contiguous()")
    if not (isinstance(b_stride, list) and b_stride[:1] == [1]):
        return (f"mat2 has strides {b_stride}: a GPU takes mat2 column-major, the transpose of a contiguous "
                "tensor (t.t().contiguous().t() lays any t out so)")
    if a.dtype == E5M2 and b.dtype == E5M2:
        return "both operands are float8_e5m2: cuBLASLt multiplies no two E5M2 matrices"
    for key in ("scale_a", "scale_b"):
        s = e.get(key)
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
            return f"{key} is {_describe(s)}: a tensorwise scale is a float32 tensor of one element"
    if e.get("bias") and e.get("out_dtype") == "float32":
        return ("it was given a bias with a float32 output, which a GPU refuses (\"Bias is not supported when "
                "out_dtype is set to Float32\"): add the bias after the product")
    return None


# --- the layer's results --------------------------------------------------------------------------


def _tolerance(tol: float, backend: str) -> float:
    return tol * (GPU_LOOSER if backend == "nccl" else 1)


def check_output(g, record, backend: str = "gloo") -> None:
    for call in CALLS:
        run, want = call_record(record, call), expected_call(call)
        value, tol = want["output"]
        got = run.get("output") if run else None
        if isinstance(got, torch.Tensor) and got.dtype != torch.float32:
            g.record("output-matches", False, f"call '{call}': the output is {got.dtype}; a float32 layer's "
                     "output stays float32 (out_dtype=torch.float32, the bias added in float32)")
            return
        found = tensor_difference(got, value, atol=_tolerance(tol, backend), name="output")
        if found is not None:
            g.record("output-matches", False, f"call '{call}' ({CALL_WORDS[call]}): {found} against the recipe's "
                     f"(x8 / scale_x) @ (w8 / scale_w)^T + bias, beyond float32's rounding of the sums "
                     f"({_tolerance(tol, backend):.2g}){_explain_output(got, call)}")
            return
    g.record("output-matches", True)


def _explain_output(got, call: str) -> str:
    exact = float32_products(call)
    if _near(got, exact["output"], 1e-5 * float(exact["output"].abs().max())):
        return "; it equals the float32 product: the float8 casts never reached it"
    want, tol = expected_call(call)["output"]
    bias = expected_call(call)["tensors"]["bias"]
    if bias is not None and _near(got, want - bias.double(), tol):
        return "; it equals the recipe's product without the bias"
    return ""


def _near(got, want: torch.Tensor, atol: float) -> bool:
    return tensor_difference(got, want, atol=max(atol, 1e-30)) is None


def check_grads(g, record, backend: str = "gloo") -> None:
    for call in CALLS:
        run, want = call_record(record, call), expected_call(call)
        grads = run.get("grads") if run else None
        grads = grads if isinstance(grads, dict) else {}
        for name, words in (("input", "x.grad"), ("weight", "weight.grad"), ("bias", "bias.grad")):
            expected = want["grads"][name]
            if expected is None:
                continue
            value, tol = expected
            got = grads.get(name)
            if got is None:
                g.record("grads-match", False, f"call '{call}': {words} is None after backward"
                         + ("" if name == "input" else f" (the layer has no parameter called {name!r}, or it "
                            "got no gradient)"))
                return
            found = tensor_difference(got, value, atol=_tolerance(tol, backend), name=words)
            if found is not None:
                g.record("grads-match", False, f"call '{call}' ({CALL_WORDS[call]}): {found} against the recipe's "
                         f"{_grad_words(name)}, beyond float32's rounding ({_tolerance(tol, backend):.2g})"
                         f"{_explain_grad(got, call, name)}")
                return
    g.record("grads-match", True)


def _grad_words(name: str) -> str:
    return {"input": "(go8 / scale_go) @ (w8 / scale_w)", "weight": "(go8 / scale_go)^T @ (x8 / scale_x)",
            "bias": "sum of the output's gradient over the rows (float32)"}[name]


def _explain_grad(got, call: str, name: str) -> str:
    if name == "bias":
        return ""
    exact = float32_products(call)[name]
    if _near(got, exact, 1e-5 * float(exact.abs().max())):
        return "; it equals float32's gradient: backward multiplied in float32"
    return ""


def check_master(g, record) -> None:
    """The layer's parameters are the linear's, float32, named as nn.Linear names them; forward and backward
    leave them as they were."""
    modules = record.get("modules") if isinstance(record, dict) else None
    layers = sorted(set(LAYER_OF.values()))
    if not isinstance(modules, dict) or sorted(modules) != layers:
        g.record("master-weights", False, f"the layers built were not recorded (layers {layers})")
        return
    for layer, described in modules.items():
        problem = _master_problem(described, layer)
        if problem is not None:
            g.record("master-weights", False, f"the layer built from nn.Linear ('{layer}' layer): {problem}")
            return
    for call in CALLS:
        run = call_record(record, call) or {}
        before, after = run.get("before"), run.get("after")
        if isinstance(before, dict) and isinstance(after, dict):
            for name, value in before.items():
                if tensor_difference(after.get(name), value, check_dtype=True) is not None:
                    g.record("master-weights", False, f"call '{call}': {name} changed during forward and backward "
                             "(rounded to float8 in place?): the float8 copies are made beside the float32 weights, "
                             "which only the optimizer changes")
                    return
        grads = run.get("grads") if isinstance(run.get("grads"), dict) else {}
        for name in ("weight", "bias"):
            grad = grads.get(name)
            if isinstance(grad, torch.Tensor) and grad.dtype != torch.float32:
                g.record("master-weights", False, f"call '{call}': {name}.grad is {grad.dtype}; the gradient of a "
                         "float32 parameter is float32 (the optimizer reads it)")
                return
    g.record("master-weights", True)


def _master_problem(described, layer: str) -> str | None:
    if not isinstance(described, dict) or not described.get("is_module"):
        return "it is not an nn.Module"
    linear = {name: p.detach() for name, p in make_linear(layer).named_parameters()}  # the grader's own
    wanted = sorted(linear)
    params = [p for p in described.get("parameters") or [] if isinstance(p, dict)]
    names = [str(p.get("name")) for p in params]
    if sorted(names) != wanted:
        return (f"its parameters are {names}; the linear's are {wanted}, float32, under the same names (an optimizer "
                "and a checkpoint of the float32 model see the same parameters)")
    for p in params:
        if p.get("dtype") != "float32" or not p.get("is_parameter") or not p.get("requires_grad"):
            return (f"{p['name']} is a {p.get('dtype')} {'Parameter' if p.get('is_parameter') else 'tensor'}"
                    f"{'' if p.get('requires_grad') else ' without requires_grad'}: the master weights stay float32 "
                    "Parameters; float8 copies are made in each forward")
    values, state = described.get("values"), described.get("state_dict")
    for name in wanted:
        found = tensor_difference(values.get(name) if isinstance(values, dict) else None, linear[name],
                                  check_dtype=True, name=name)
        if found is not None:
            return f"{found}: the parameters hold the linear's values"
    keys = sorted(map(str, state)) if isinstance(state, dict) else state
    if keys != wanted or any(tensor_difference(state[name], linear[name], check_dtype=True) for name in wanted):
        return (f"its state_dict has {keys}; nn.Linear's has {wanted}, the float32 values: a float32 checkpoint must "
                "load into the float8 model and back (keep no float8 copies or amax histories in buffers)")
    return None


# --- training -----------------------------------------------------------------------------------


def check_training(g, record) -> None:
    training = record.get("training") if isinstance(record, dict) else None
    reference = training_reference()
    if not isinstance(training, dict):
        g.record("training-close", False, "no training was recorded")
        return
    losses = training.get("losses")
    losses = losses if isinstance(losses, list) else []
    for step, (got, want) in enumerate(zip(losses, reference["losses"]), start=1):
        if not isinstance(got, float) or not math.isfinite(got) or abs(got - want) > TRAINING_TOLERANCE * want:
            g.record("training-close", False, f"step {step} of {STEPS}: the loss is {got!r} against float32's "
                     f"{want:.6g}, off by more than 1/8 of it (float32's loss at the steps before: "
                     f"{', '.join(f'{v:.4g}' for v in reference['losses'][:step])}; yours: "
                     f"{', '.join(f'{v:.4g}' if isinstance(v, float) else '?' for v in losses[:step])})")
            return
    if training.get("error") or len(losses) != STEPS:
        g.record("training-close", False, f"after {len(losses)} step(s) of {STEPS}: "
                 f"{training.get('error') or 'the losses were not recorded'}")
        return
    params = ordered_weights(training.get("params"))
    if params is None:
        wanted = [f"{name} {list(shape)}" for name, shape in reference["params"]]
        g.record("training-close", False, f"the MLP's parameters after training are not the float32 model's "
                 f"{len(wanted)} finite tensors ({', '.join(wanted)})")
        return
    got, want = loss_of(params), reference["final_loss"]
    if abs(got - want) > TRAINING_TOLERANCE * want:
        g.record("training-close", False, f"the weights after {STEPS} steps, put in a float32 MLP, give a loss of "
                 f"{got:.6g} against float32 training's {want:.6g}: off by more than 1/8")
        return
    g.record("training-close", True)


# --- the all-gather -------------------------------------------------------------------------------


def _gathered(run) -> tuple[torch.Tensor, torch.Tensor] | str:
    """(weight, scale) a rank returned, or what is wrong with it."""
    returned = run.get("returned") if isinstance(run, dict) else None
    items = returned.get("items") if isinstance(returned, dict) else None
    if not isinstance(items, list) or len(items) != 2:
        kind = returned.get("kind") if isinstance(returned, dict) else None
        return f"it returned a {kind} where (the float8 weight, its scale) is two tensors"
    weight, scale = items
    if not isinstance(weight, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return f"it returned ({_describe(weight)}, {_describe(scale)}) where two tensors were expected"
    return weight, scale


def _gather_problem(run, scenario: str, size: int) -> str | None:
    got = _gathered(run)
    if isinstance(got, str):
        return got
    weight, scale = got
    want, want_scale = gather_expected(scenario, size)
    if weight.dtype == torch.uint8 and tuple(weight.shape) == tuple(want.shape):
        return "the weight came back as uint8: view the gathered bytes back as float8_e4m3fn"
    found = tensor_difference(weight.view(torch.uint8) if weight.dtype == E4M3 else weight,
                              want.view(torch.uint8), check_dtype=True, name="the gathered weight")
    if weight.dtype != E4M3:
        return f"the gathered weight is {_describe(weight)}; it is float8_e4m3fn, [{size * GATHER_ROWS}, {GATHER_COLS}]"
    if found is not None:
        why = _explain_gather(weight, scenario, size)
        return f"{found} (its bytes) against the whole weight cast with one scale{why}"
    if scale.numel() != 1:
        return f"the scale returned is {_describe(scale)}, not a one-element tensor"
    value, want = float(scale.reshape(-1)[0]), float(want_scale)
    if not (math.isfinite(value) and abs(value - want) <= SCALE_RTOL * want):
        said = f"the scale returned is {value:.8g}; the whole weight's is {want:.8g} (weight ~ result.float() / scale)"
        if math.isfinite(value) and abs(value * want - 1) <= SCALE_RTOL:
            said += ": this is its reciprocal"
        return said
    if scale.dtype != torch.float32:
        return (f"the scale returned is {str(scale.dtype).removeprefix('torch.')}; it is a float32 tensor of one "
                "element, as torch._scaled_mm takes its scales (a GPU refuses another dtype)")
    return None


def _explain_gather(weight: torch.Tensor, scenario: str, size: int) -> str:
    if tuple(weight.shape) != (size * GATHER_ROWS, GATHER_COLS):
        return ""
    signed = signed_amax_cast(scenario, size)
    if signed is not None and torch.equal(weight.view(torch.uint8), signed[0].view(torch.uint8)):
        return (f"; it is the whole weight cast with the scale of its largest value ({signed[1]:.4g}), not of its "
                f"largest magnitude ({float(gather_weight(scenario, size).abs().max()):.4g}): the amax is the max of "
                "|x| (x.abs().max()), so that a negative value of larger magnitude does not saturate")
    for q, own, amax in own_shard_casts(scenario, size):
        if torch.equal(weight[q * GATHER_ROWS:(q + 1) * GATHER_ROWS].view(torch.uint8), own.view(torch.uint8)):
            return (f"; the rows of rank {q} of the group were cast with that shard's own amax ({amax:.4g}, where the "
                    f"whole weight's is {float(gather_weight(scenario, size).abs().max()):.4g}): all-reduce the amax "
                    "with MAX first, so that every shard shares one scale")
    return ""


def check_gather(g, observations: list, world_size: int) -> None:
    for scenario in GATHER_SCENARIOS:
        for rank, obs in enumerate(observations):
            run = obs.get(scenario) if isinstance(obs, dict) else None
            problem = _gather_problem(run, scenario, world_size)
            if problem is not None:
                g.record("gather-matches", False, f"world size {world_size}, rank {rank} "
                         f"({_gather_words(scenario, world_size)}): {problem}", rank=rank, world_size=world_size)
                return
    g.record("gather-matches", True)


def _gather_words(scenario: str, size: int) -> str:
    said = f"a weight of {size * GATHER_ROWS} x {GATHER_COLS}, {GATHER_ROWS} rows per rank"
    if scenario == "outlier":
        said += (f", the last rank's shard holding one value of {GATHER_OUTLIER[1]:g}, the others below "
                 f"{1 / math.sqrt(GATHER_COLS):.2g} in magnitude")
    return said


def clean_events(run) -> list[dict] | None:
    events = run.get("events") if isinstance(run, dict) else None
    if not isinstance(events, list):
        return None
    out = []
    for e in events:
        if not isinstance(e, dict) or not isinstance(e.get("op"), str) or not isinstance(e.get("bytes"), int) \
                or isinstance(e.get("bytes"), bool) or e["bytes"] < 0:
            return None
        dtype = e.get("dtype")
        out.append({"op": e["op"], "bytes": e["bytes"], "dtype": dtype if isinstance(dtype, str) else None})
    return out


def _bytes_problem(events: list[dict]) -> str | None:
    shard = GATHER_ROWS * GATHER_COLS
    payload = [e for e in events if e["op"] in GATHER_OPS and e["bytes"] > SMALL_BYTES]
    other = [e for e in events if e not in payload]
    sent = sum(e["bytes"] for e in payload)
    if not payload:
        big = max(events, key=lambda e: e["bytes"], default=None)
        said = f"; its largest collective is a {big['op']} of {big['bytes']} bytes" if big else ""
        return f"no all-gather carried the shard{said}: FSDP2 all-gathers each rank's shard in one collective"
    wide = next((e for e in payload if e["dtype"] not in ONE_BYTE), None)
    if wide is not None or sent != shard:
        dtype = (wide or payload[0])["dtype"]
        return (f"its all-gathers sent {sent} bytes ({dtype}) for a shard of {shard} values: {sent / shard:g} bytes "
                "per element; the shard travels as float8, one byte per element (cast before the gather, and send "
                "the float8 tensor's bytes: t8.view(torch.uint8))")
    small = sum(e["bytes"] for e in other)
    if small > SMALL_BYTES:
        e = max(other, key=lambda e: e["bytes"])
        return (f"besides its shard it sent {small} bytes (a {e['op']} of {e['bytes']} bytes of {e['dtype']}); one "
                "amax is all it needs to agree on the scale")
    return None


def check_gather_bytes(g, observations: list, world_size: int) -> None:
    for scenario in GATHER_SCENARIOS:
        for rank, obs in enumerate(observations):
            events = clean_events(obs.get(scenario) if isinstance(obs, dict) else None)
            problem = "its collectives were not recorded" if events is None else _bytes_problem(events)
            if problem is not None:
                g.record("gather-bytes", False, f"world size {world_size}, rank {rank} ({scenario}): {problem}",
                         rank=rank, world_size=world_size)
                return
    g.record("gather-bytes", True)


def check_gather_group(g, observations: list, world_size: int) -> None:
    for rank, obs in enumerate(observations):
        run = obs.get("group") if isinstance(obs, dict) else None
        members = next(m for m in groups_of(world_size) if rank in m)  # the grader's groups, not the record's
        problem = "the group scenario recorded nothing" if not isinstance(run, dict) else \
            _gather_problem(run, "plain", len(members))
        if problem is not None:
            g.record("gather-group", False, f"world size {world_size}, rank {rank} in group={members} (rank "
                     f"{members.index(rank)} of {len(members)} there, each group gathering a weight of its own): "
                     f"{problem}", rank=rank, world_size=world_size)
            return
    g.record("gather-group", True)
