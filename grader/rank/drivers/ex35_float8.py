"""Exercise 35, rank side: the tensors both sides build (the grader builds the same), the scenarios a rank runs
with the learner's Float8Linear and float8_all_gather, and what it records: every matrix product its layer
dispatched in forward and in backward (for a torch._scaled_mm: both operands, their strides, the scales, the
output dtype), the output, the gradients and the parameters before and after; twenty AdamW steps of an MLP
whose Linears are swapped for the learner's; and for the all-gather what each rank returned and every
collective it dispatched with the bytes it sent."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from grader.rank import rank_timeline
from grader.rank.child import RankContext
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.recording import plain_tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's: the amax is clamped to it, so an all-zero tensor gets a finite scale

# The layer: x [BATCH, SEQ, IN] through Linear(IN, OUT). The three sizes of its products differ (ROWS, IN, OUT),
# so an operand's shape says which tensor it is; each a multiple of 16, as a GPU's float8 product needs.
BATCH, SEQ, IN, OUT = 2, 8, 64, 48
ROWS = BATCH * SEQ
# The calls, in order. "plain" and "outlier" are two calls of one layer: between them the weight changes in
# place (an optimizer step would), gaining an outlier, and the input and the output's gradient each hold one
# (negative: max() without abs() misses it). "zero-weight" is a layer initialised to zero (LoRA's B, a zero-init
# projection): its amax is 0. "no-bias" has no bias.
CALLS = ("plain", "outlier", "zero-weight", "no-bias")
LAYER_OF = {"plain": "plain", "outlier": "plain", "zero-weight": "zero-weight", "no-bias": "no-bias"}
SEEDS = {"plain": 1, "outlier": 2, "zero-weight": 3, "no-bias": 7, "training": 5, "gather": 6}
GRAD_SCALE = 1e-3  # the output's gradient: a gradient's size, far below the activations'
OUTLIERS = {"input": ((1, 5, 20), -300.0), "weight": ((7, 11), -2.0), "grad": ((0, 3, 40), -0.5)}

# Training: an MLP of three Linears (the last without bias), GELU between, mean squared error against a fixed
# teacher's outputs, AdamW (written out below, float32 state) for STEPS steps.
MLP_SIZES = (64, 128, 64, 16)
TRAIN_BATCH, TRAIN_SEQ = 8, 16
STEPS, LR, BETAS, ADAM_EPS, WEIGHT_DECAY = 20, 3e-3, (0.9, 0.999), 1e-8, 0.01

# The all-gather: a weight of GATHER_ROWS rows per rank, GATHER_COLS columns, values of an initialised weight;
# in "outlier" the last rank's shard holds one negative value, far larger in magnitude than the rest (an amax taken
# without abs misses it).
GATHER_ROWS, GATHER_COLS = 16, 24
GATHER_SCENARIOS = ("plain", "outlier")
GATHER_OUTLIER = ((GATHER_ROWS - 3, 5), -1.5)
PRODUCT_OPS = ("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "vdot", "matmul", "addbmm", "linear",
               "_scaled_mm", "_scaled_mm_v2", "_int_mm", "_scaled_grouped_mm", "_grouped_mm")
SCALED_MM = "_scaled_mm"
NOT_MESSAGES = ("wait_tensor", "_wrap_tensor_autograd")


# --- shared by ranks and grader -----------------------------------------------------------------


def _generator(name: str, extra: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(35_000 + 100 * SEEDS[name] + extra)


def make_linear(layer: str) -> nn.Linear:
    """The seeded float32 nn.Linear(IN, OUT) of a layer: "plain", "zero-weight" or "no-bias"."""
    generator = _generator(layer)
    linear = nn.Linear(IN, OUT, bias=layer != "no-bias")
    with torch.no_grad():
        bound = 1 / math.sqrt(IN)
        linear.weight.copy_((torch.rand(OUT, IN, generator=generator) * 2 - 1) * bound)
        if layer == "zero-weight":
            linear.weight.zero_()
        if linear.bias is not None:
            linear.bias.copy_((torch.rand(OUT, generator=generator) * 2 - 1) * bound)
    return linear


def call_inputs(call: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The input x [BATCH, SEQ, IN] and the output's gradient G [BATCH, SEQ, OUT] of a call: backward runs on
    sum(output * G), so the output's gradient is G exactly."""
    generator = _generator(call)
    x = torch.randn(BATCH, SEQ, IN, generator=generator)
    grad = torch.randn(BATCH, SEQ, OUT, generator=generator) * GRAD_SCALE
    if call == "outlier":
        x[OUTLIERS["input"][0]] = OUTLIERS["input"][1]
        grad[OUTLIERS["grad"][0]] = OUTLIERS["grad"][1]
    return x, grad


def plant_weight_outlier(weight: torch.Tensor) -> None:
    """What changes the "plain" layer's weight before its second call, in place."""
    with torch.no_grad():
        weight[OUTLIERS["weight"][0]] = OUTLIERS["weight"][1]


def make_mlp() -> nn.Sequential:
    """The float32 MLP both sides train, seeded."""
    generator = _generator("training")
    a, b, c, d = MLP_SIZES
    model = nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Linear(b, c), nn.GELU(), nn.Linear(c, d, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else b
            p.copy_((torch.rand(p.shape, generator=generator) * 2 - 1) / math.sqrt(fan_in))
    return model


def training_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [TRAIN_BATCH, TRAIN_SEQ, 64] and a fixed teacher's outputs [.., 16] to regress."""
    generator = _generator("training", 1)
    x = torch.randn(TRAIN_BATCH, TRAIN_SEQ, MLP_SIZES[0], generator=generator)
    teacher = torch.randn(MLP_SIZES[0], MLP_SIZES[-1], generator=generator) / 8
    return x, torch.tanh(x @ teacher)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def adamw_step(params: list[torch.Tensor], state: list, step: int) -> None:
    """One AdamW step (decoupled weight decay) with float32 moments, as torch.optim.AdamW computes it."""
    beta1, beta2 = BETAS
    with torch.no_grad():
        for i, p in enumerate(params):
            if len(state) <= i:
                state.append((torch.zeros_like(p), torch.zeros_like(p)))
            m, v = state[i]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            p.mul_(1 - LR * WEIGHT_DECAY)
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denominator = (v / (1 - beta2 ** step)).sqrt().add_(ADAM_EPS)
            p.addcdiv_(m, denominator, value=-LR / (1 - beta1 ** step))


def gather_weight(scenario: str, size: int) -> torch.Tensor:
    """The whole weight [size * GATHER_ROWS, GATHER_COLS] a group of ``size`` ranks all-gathers."""
    generator = _generator("gather", 10 * size + GATHER_SCENARIOS.index(scenario))
    weight = (torch.rand(size * GATHER_ROWS, GATHER_COLS, generator=generator) * 2 - 1) / math.sqrt(GATHER_COLS)
    if scenario == "outlier":
        (row, col), value = GATHER_OUTLIER
        weight[(size - 1) * GATHER_ROWS + row, col] = value
    return away_from_ties(weight, E4M3)


def away_from_ties(t: torch.Tensor, float8_dtype: torch.dtype, slack: float = 2.0 ** -20) -> torch.Tensor:
    """``t`` with every value whose scaled value lies within ``slack`` (relative) of a float8 rounding boundary moved
    a little away from it: there, ways of computing t * scale that round apart in float32 would cast apart."""
    largest = torch.finfo(float8_dtype).max
    scale = (largest / torch.clamp(t.abs().max().double(), min=EPS)).float().double()
    exact = t.double() * scale
    low, high = ((exact * (1 + side * slack)).clamp(-largest, largest).to(float8_dtype) for side in (-1, 1))
    near = low.float() != high.float()
    return torch.where(near, t * (1 + 16 * slack), t)


def groups_of(world_size: int) -> list[list[int]]:
    """Every rank but rank 1, whose ranks in the group differ from their global ranks, and rank 1 alone."""
    if world_size < 2:
        return [[0]]
    return [[r for r in range(world_size) if r != 1], [1]]


# --- in each rank: the layer ---------------------------------------------------------------------


def _op_name(func) -> str:
    """aten._scaled_mm.default -> _scaled_mm."""
    parts = str(func).split(".")
    return parts[1] if len(parts) > 2 else str(func)


def describe_product(func, args, kwargs) -> dict:
    """One matrix product as plain data; for torch._scaled_mm its operands, their strides, the scales it was
    given (to multiply by), its bias and its output dtype."""
    name = _op_name(func)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    event = {"op": name, "shapes": [list(t.shape) for t in tensors],
             "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors]}
    if name == SCALED_MM:
        names = ("a", "b", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")
        bound = dict(zip(names, args))
        bound.update(kwargs or {})
        for key in ("a", "b"):
            t = bound.get(key)
            event[key] = plain_tensor(t)
            event[f"{key}_stride"] = list(t.stride()) if isinstance(t, torch.Tensor) else None
        event["scale_a"], event["scale_b"] = plain_tensor(bound.get("scale_a")), plain_tensor(bound.get("scale_b"))
        event["bias"] = bound.get("bias") is not None
        event["scale_result"] = bound.get("scale_result") is not None
        out_dtype = bound.get("out_dtype")
        event["out_dtype"] = str(out_dtype).removeprefix("torch.") if out_dtype is not None else None
    return event


@functools.cache
def _watch_class():
    """The dispatch mode below, defined on first use."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        """Records every matrix product dispatched while on (below autograd: its backward's too)."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # nothing here is compiled: without this the first use imports torch._dynamo (2 s)

        def __init__(self):
            super().__init__()
            self.events: list[dict] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _op_name(func) in PRODUCT_OPS:
                self.events.append(describe_product(func, args, kwargs))
            return func(*args, **(kwargs or {}))

    return Products


def _parameters(module) -> dict:
    return {name: plain_tensor(p) for name, p in module.named_parameters()}


def describe_module(layer) -> dict:
    """What the learner's layer holds right after it was built."""
    try:
        state = {key: plain_tensor(value) for key, value in layer.state_dict().items()}
    except Exception as exc:  # the observation
        state = {"error": learner_error(exc)}
    return {
        "type": type(layer).__name__,
        "is_module": isinstance(layer, nn.Module),
        "parameters": [{"name": name, "dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape),
                        "is_parameter": isinstance(p, nn.Parameter), "requires_grad": bool(p.requires_grad)}
                       for name, p in layer.named_parameters()] if isinstance(layer, nn.Module) else [],
        "values": _parameters(layer) if isinstance(layer, nn.Module) else {},
        "state_dict": state,
    }


def run_call(layer, linear: nn.Linear, call: str, device: torch.device) -> dict:
    """Forward and backward of sum(layer(x) * G) for one call: the products each dispatched, the output, the
    gradients, and the parameters before and after."""
    x_values, grad = call_inputs(call)
    x = x_values.to(device).requires_grad_(True)
    record = {"before": _parameters(layer), "forward": [], "backward": [], "output": None, "grads": {},
              "backward_ran": False}
    for p in layer.parameters():
        p.grad = None
    forward = _watch_class()()
    try:
        with forward:
            out = layer(x)
    except NotImplementedError:
        raise
    except Exception as exc:  # the observation; the other calls still run
        record.update(forward=forward.events, error=learner_error(exc))
        return record
    record.update(forward=forward.events, output=plain_tensor(out))
    if isinstance(out, torch.Tensor) and out.requires_grad and tuple(out.shape) == tuple(grad.shape):
        backward = _watch_class()()
        try:
            with backward:
                (out * grad.to(device)).sum().backward()
            record["backward_ran"] = True
        except Exception as exc:  # the observation
            record["error"] = learner_error(exc)
        record["backward"] = backward.events
    # The layer's weight and bias by those names; else the linear's own, which a layer that wraps it still trains.
    own = dict(layer.named_parameters())
    grads = {name: own[name].grad if name in own else getattr(getattr(linear, name), "grad", None)
             for name in ("weight", "bias")}
    record["grads"] = {"input": plain_tensor(x.grad), **{name: plain_tensor(grad) for name, grad in grads.items()}}
    record["after"] = _parameters(layer)
    return record


def _train(Float8Linear, device: torch.device) -> dict:
    """STEPS AdamW steps of the MLP with every nn.Linear swapped for Float8Linear(linear)."""
    model = make_mlp()
    for index, module in enumerate(model):
        if isinstance(module, nn.Linear):
            model[index] = Float8Linear(module)
    model = model.to(device)
    x, target = (t.to(device) for t in training_data())
    params, state, losses = list(model.parameters()), [], []
    names = [name for name, _ in model.named_parameters()]
    try:
        for step in range(1, STEPS + 1):
            for p in params:
                p.grad = None
            loss = loss_fn(model(x), target)
            loss.backward()
            losses.append(float(loss.detach()))
            adamw_step(params, state, step)
    except NotImplementedError:
        raise
    except Exception as exc:  # the observation: the steps before it are judged
        return {"losses": losses, "params": dict(zip(names, map(plain_tensor, params))), "error": learner_error(exc)}
    return {"losses": losses, "params": dict(zip(names, map(plain_tensor, params))), "error": None}


def linear_main(ctx: RankContext) -> dict:
    """Every call of the learner's Float8Linear, then training: one process, no group."""
    Float8Linear = ctx.function("Float8Linear")
    device = ctx.device
    layers, linears, modules, calls = {}, {}, {}, {}
    for call in CALLS:
        name = LAYER_OF[call]
        if name not in layers:
            linears[name] = make_linear(name).to(device)
            layers[name] = Float8Linear(linears[name])
            modules[name] = describe_module(layers[name])
        layer = layers[name]
        if call == "outlier":  # the weight changes between the two calls, as an optimizer step changes it
            own = dict(layer.named_parameters()).get("weight") if isinstance(layer, nn.Module) else None
            plant_weight_outlier(own if own is not None else linears[name].weight)
        calls[call] = run_call(layer, linears[name], call, device)
    return {"modules": modules, "calls": calls, "training": _train(Float8Linear, device)}


# --- in each rank: the all-gather ----------------------------------------------------------------


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _first_dtype(value) -> str | None:
    if isinstance(value, (list, tuple)):
        value = next((v for v in (_flat(value)) if isinstance(v, torch.Tensor)), None)
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return [value]


# Where each dispatched collective keeps what this rank sends: c10d's ops take (outputs, inputs, ...) for the
# gathers, scatters and all-to-alls, the tensors themselves otherwise; the functional ones take the input first.
SENT_ARGUMENT = {"allgather_": 1, "_allgather_base_": 1, "allgather_coalesced_": 1,
                 "allgather_into_tensor_coalesced_": 1, "reduce_scatter_": 1, "_reduce_scatter_base_": 1,
                 "reduce_scatter_tensor_coalesced_": 1, "alltoall_": 1, "alltoall_base_": 1, "gather_": 1,
                 "scatter_": 1, "recv_": None, "recv_any_source_": None}


def describe_message(func) -> str:
    return str(func).split(".")[1] if "." in str(func) else str(func)


@functools.cache
def _messages_class():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Messages(TorchDispatchMode):
        """Records every collective dispatched while on: its name, and the bytes and dtype this rank sent."""

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False

        def __init__(self):
            super().__init__()
            self.events: list[dict] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
                name = describe_message(func)
                if not any(word in name for word in NOT_MESSAGES):
                    where = SENT_ARGUMENT.get(name, 0)
                    sent = args[where] if where is not None and len(args) > where else None
                    self.events.append({"op": name, "bytes": _bytes(sent), "dtype": _first_dtype(sent)})
            return func(*args, **(kwargs or {}))

    return Messages


def _gather_case(gather, scenario: str, members: list[int], rank: int, device, group) -> dict:
    me = members.index(rank)
    shard = gather_weight(scenario, len(members))[me * GATHER_ROWS:(me + 1) * GATHER_ROWS].to(device)
    messages = _messages_class()()
    with messages:
        result = gather(shard, group)
    if isinstance(result, (tuple, list)):
        returned = {"kind": type(result).__name__, "items": [plain_tensor(r) if isinstance(r, torch.Tensor) else
                                                             {"not_a_tensor": type(r).__name__} for r in result]}
    else:
        returned = {"kind": type(result).__name__, "items": None}
    return {"returned": returned, "events": messages.events, "members": members}


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    """float8_all_gather on this rank's shard of each scenario's weight; in the largest world, in two groups."""
    with ctx.group():
        gather = ctx.function("float8_all_gather")
        everyone = list(range(ctx.world_size))
        obs = {scenario: _gather_case(gather, scenario, everyone, ctx.rank, ctx.device, dist.group.WORLD)
               for scenario in GATHER_SCENARIOS}
        if ctx.kwargs.get("groups"):
            groups = groups_of(ctx.world_size)
            handles = [dist.new_group(members) for members in groups]  # every rank makes every group
            mine = next(i for i, members in enumerate(groups) if ctx.rank in members)
            obs["group"] = _gather_case(gather, "plain", groups[mine], ctx.rank, ctx.device, handles[mine])
        return obs
