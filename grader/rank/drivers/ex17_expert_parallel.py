"""Exercise 17, rank side: the router and experts every rank builds (seeded, the same everywhere), which rank
owns which expert, and what a rank records of the learner's ExpertParallelMoE: outputs, auxiliary loss,
gradients, the bytes it holds, every message with its rows."""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from grader.rank import memory, probes, rank_timeline
from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.drivers.shared.recording import all_ok, plain_tensor
from grader.rank.child import RankContext

D, HIDDEN, TOKENS, EXPERTS, TOP_K = 8, 16, 16, 12, 2  # EXPERTS: divisible by 2, 3 and 4
DTYPE = torch.float64
AUX_WEIGHT = 0.5  # backward runs on sum(y * G) + AUX_WEIGHT * aux_loss
# capacity_factor and the router's bias towards one expert, per scenario. "plain": C = tokens, nothing is
# dropped; "tight": C = ceil(16 * 2 / 12) = 3, a few assignments dropped; "skewed": nearly every token's
# first choice is the same expert, which takes C = 4 of them from each rank.
SCENARIOS = {"plain": (6.0, 0.0), "tight": (1.0, 0.0), "skewed": (1.25, 8.0)}
SKEWED_EXPERT = 5  # the expert the skewed router prefers (rank 1's with 2 ranks, rank 2's with 3 or 4)
SEEDS = {"plain": 1, "tight": 2, "skewed": 3, "bad": 4}
RTOL, ATOL = 1e-9, 1e-12  # float64; ATOL times the largest |value| of the expected tensor
HELD_SLACK = 4096  # bytes a module may hold beyond the router and its experts with their gradients
STALL_TIMEOUT_S = 5.0  # after the first scenario: a rank that failed must not leave the others waiting
REFUSALS = ("ValueError", "AssertionError")
ALL_TO_ALLS = ("alltoall_base_", "alltoall_", "all_to_all_single", "all_to_all")
# Ops of the c10d namespaces that move no data.
NOT_MESSAGES = ("wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_")


def bad_experts(world_size: int) -> int:
    """An expert count the world size does not divide."""
    return 2 * world_size + 1


def build(scenario: str, world_size: int, experts: int = EXPERTS) -> dict:
    """The router, the experts, every rank's tokens x and output gradient G of one scenario (float64)."""
    generator = torch.Generator().manual_seed(1000 + SEEDS[scenario] * 100 + world_size)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, dtype=DTYPE) * scale

    router = nn.Linear(D, experts).to(DTYPE)
    expert_list = [nn.Sequential(nn.Linear(D, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, D)).to(DTYPE)
                   for _ in range(experts)]
    with torch.no_grad():
        router.weight.copy_(randn(experts, D, scale=0.5))
        router.bias.copy_(randn(experts, scale=0.1))
        bias = SCENARIOS.get(scenario, (1.0, 0.0))[1]
        if bias:
            router.bias[SKEWED_EXPERT] += bias
        for expert in expert_list:
            for p in expert.parameters():
                p.copy_(randn(*p.shape, scale=0.4))
    xs = [randn(TOKENS, D) for _ in range(world_size)]
    gs = [randn(TOKENS, D) for _ in range(world_size)]
    return {"router": router, "experts": expert_list, "x": xs, "g": gs}


def owner(expert: int, world_size: int, experts: int = EXPERTS) -> int:
    return expert // (experts // world_size)


def _tensor_args(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def describe_message(func, args, rank: int, world_size: int) -> dict:
    """One c10d op as plain data: its name, dtype, bytes and, for an all-to-all, the bytes it sends to
    other ranks (``off_rank``) and its rows per destination (``rows``)."""
    name = func.name().split("::")[-1].split(".")[0]
    event = {"op": name, "dtype": None, "bytes": 0, "off_rank": None, "rows": None, "peer": None}
    try:
        if name == "alltoall_base_":  # (output, input, group, output_split_sizes, input_split_sizes, ...)
            sent, splits = args[1], list(args[4])
        elif name == "all_to_all_single":  # functional: (input, output_split_sizes, input_split_sizes, group)
            sent, splits = args[0], list(args[2] or [])
        elif name == "alltoall_":  # (output_tensors, input_tensors, group, ...)
            pieces = _tensor_args(args[1])
            event.update(dtype=str(pieces[0].dtype).removeprefix("torch.") if pieces else None,
                         bytes=sum(t.numel() * t.element_size() for t in pieces),
                         rows=[int(t.shape[0]) if t.dim() else 1 for t in pieces])
            event["off_rank"] = sum(t.numel() * t.element_size() for i, t in enumerate(pieces) if i != rank)
            return event
        else:
            tensors = _tensor_args(args[0]) if args else []
            if name in ("send", "recv_") and len(args) > 2 and isinstance(args[2], int):
                event["peer"] = int(args[2])
            if tensors:
                event.update(dtype=str(tensors[0].dtype).removeprefix("torch."),
                             bytes=sum(t.numel() * t.element_size() for t in tensors))
            return event
        rows_total = int(sent.shape[0]) if sent.dim() else sent.numel()
        row_bytes = (sent.numel() // rows_total) * sent.element_size() if rows_total else \
            math.prod(sent.shape[1:]) * sent.element_size()
        if not splits:
            splits = [rows_total // world_size] * world_size
        event.update(dtype=str(sent.dtype).removeprefix("torch."), bytes=sent.numel() * sent.element_size(),
                     rows=[int(s) for s in splits])
        event["off_rank"] = sum(int(s) for i, s in enumerate(splits) if i != rank) * row_bytes
    except (IndexError, TypeError, AttributeError, ValueError):
        pass
    return event


class _Messages:
    """Every c10d op dispatched while on (probes.watch_dispatched_collectives), described as a message."""

    def __init__(self, rank: int, world_size: int):
        self.events: list[dict] = []
        self.rank, self.world_size = rank, world_size
        self._mode = probes.watch_dispatched_collectives(self._record)

    def _record(self, func, args) -> None:
        if func.namespace in ("c10d", "_c10d_functional") and \
                func.name().split("::")[-1].split(".")[0] not in NOT_MESSAGES:
            self.events.append(describe_message(func, args, self.rank, self.world_size))

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _fingerprints(experts: list[nn.Module]) -> dict[str, bytes]:
    """The bytes of every expert's first weight, by expert number."""
    return {str(i): memory.tensor_bytes(next(e.parameters())) for i, e in enumerate(experts)}


def _held(module, learner, fingerprints: dict[str, bytes]) -> dict:
    """What the module holds: the bytes of its distinct storages, and which experts' weights lie in them."""
    storages = memory.distinct_storages(memory.reachable_tensors([module], learner.__name__))
    contents = [memory.storage_bytes(s) for s in storages.values()]
    return {"bytes": sum(s.nbytes() for s in storages.values()),
            "experts": sorted(int(i) for i in memory.found_in(contents, fingerprints))}


def _run_case(ctx: RankContext, cls, learner, scenario: str, measure: bool) -> dict:
    """Build the layer, forward and backward on this rank's tokens: the tensors, the messages, what it holds."""
    world_size, rank = ctx.world_size, ctx.rank
    data = build(scenario, world_size)
    capacity_factor = SCENARIOS[scenario][0]
    router, experts = data["router"].to(ctx.device), [e.to(ctx.device) for e in data["experts"]]
    x = data["x"][rank].to(ctx.device).requires_grad_(True)
    g = data["g"][rank].to(ctx.device)
    del data
    module = cls(router, experts, TOP_K, capacity_factor)
    run = {"held": None, "held_after": None}
    prints = _fingerprints(experts) if measure else {}
    if measure:
        run["held"] = _held(module, learner, prints)
    watch = _Messages(rank, world_size)
    with watch:
        result = module(x)
    run["forward_events"] = watch.events
    pair = isinstance(result, (tuple, list)) and len(result) == 2
    y, aux = (result[0], result[1]) if pair else (result, None)
    run.update(output=plain_tensor(y), aux=plain_tensor(aux), returned=type(result).__name__ if not pair else "pair",
               backward_events=[], backward_ran=False, grads=None)
    ok = pair and isinstance(y, torch.Tensor) and y.requires_grad and tuple(y.shape) == tuple(x.shape) \
        and isinstance(aux, torch.Tensor) and aux.numel() == 1
    if not all_ok(ok, ctx.device):
        return run
    watch = _Messages(rank, world_size)
    with watch:
        loss = (y * g).sum() + AUX_WEIGHT * aux.reshape(())
        loss.backward()
    run["backward_events"] = watch.events
    run["backward_ran"] = True
    run["grads"] = {
        "x": plain_tensor(x.grad),
        "router": [plain_tensor(p.grad) for p in router.parameters()],
        "experts": {i: [plain_tensor(p.grad) for p in experts[i].parameters()]
                    for i in range(EXPERTS) if owner(i, world_size) == rank},
    }
    if measure:
        run["held_after"] = _held(module, learner, prints)
    return run


@rank_timeline.traced
def rank_main(ctx: RankContext) -> dict:
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        cls = ctx.function("ExpertParallelMoE")
        learner = ctx.learner()
        with rank_timeline.region("plain"):
            obs = {"plain": _run_case(ctx, cls, learner, "plain", measure=True)}
        # From here on a rank that fails may leave the others in a collective: a short timeout turns
        # that into an error instead of a hang.
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        for scenario in ("tight", "skewed"):
            try:
                with rank_timeline.region(scenario):
                    obs[scenario] = _run_case(ctx, cls, learner, scenario, measure=False)
            except Exception as exc:  # the observation; nothing after it runs (peers may be mid-collective)
                obs[scenario] = {"error": learner_error(exc)}
                break
        return obs


def _attempt(call) -> dict:
    try:
        result = call()
    except NotImplementedError:
        raise
    except Exception as exc:  # the observation: a refusal, or an accident of the input
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            frames.append(os.path.basename(tb.tb_frame.f_code.co_filename))
            tb = tb.tb_next
        return {"raised": type(exc).__name__, "message": str(exc)[:300], "where": frames[-1] if frames else None}
    shape = list(result[0].shape) if isinstance(result, (tuple, list)) and result and \
        isinstance(result[0], torch.Tensor) else None
    return {"raised": None, "shape": shape}


def bad_input_main(ctx: RankContext) -> dict:
    """What the learner's layer does with an expert count the world size does not divide, and with tokens
    of the wrong shape."""
    probes.torchrun_environment(ctx.rank, ctx.world_size)
    with ctx.group():
        cls = ctx.function("ExpertParallelMoE")
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=STALL_TIMEOUT_S))
        world_size = ctx.world_size
        obs = {}
        odd = build("bad", world_size, experts=bad_experts(world_size))
        obs["experts"] = _attempt(lambda: cls(odd["router"], odd["experts"], TOP_K, 1.0))
        data = build("bad", world_size)
        try:
            module = cls(data["router"], data["experts"], TOP_K, 1.0)
        except NotImplementedError:
            raise
        except Exception as exc:
            obs["build_error"] = learner_error(exc)
            return obs
        x = data["x"][ctx.rank]
        obs["columns"] = _attempt(lambda: module(torch.cat([x, x[:, :1]], dim=1)))
        obs["three_d"] = _attempt(lambda: module(x.reshape(2, TOKENS // 2, D)))
        return obs
