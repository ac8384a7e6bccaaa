"""Exercise 17, grader side: the same mixture of experts in one process (routing with capacity, the
auxiliary loss, each rank's rows), and the answers a wrong routing would give (named in a failure)."""

from __future__ import annotations

import copy
import math

import torch

from grader.rank.drivers.ex17_expert_parallel import AUX_WEIGHT, D, EXPERTS, SCENARIOS, TOKENS, TOP_K, build, owner


# --- memory and messages ------------------------------------------------------------------------


def expert_bytes() -> int:
    params = D * 16 + 16 + 16 * D + D  # two Linear layers of rank.build (HIDDEN = 16)
    return params * 8


def router_bytes() -> int:
    return (D * EXPERTS + EXPERTS) * 8

def route(router, x: torch.Tensor, top_k: int, capacity_factor: float, *, renormalise: bool = True,
          order: str = "choice", capacity: int | None = None) -> dict:
    """The routing of one rank's tokens: probabilities, choices, gates and which assignments are kept.
    ``order``: "choice" (every first choice, then every second one: the statement's), "token" (token by
    token, both choices together: a wrong order) or "none" (nothing dropped)."""
    probs = torch.softmax(router(x), dim=-1)
    top_probs, top_experts = probs.topk(top_k, dim=-1)
    gates = top_probs / top_probs.sum(dim=-1, keepdim=True) if renormalise else top_probs
    tokens = x.shape[0]
    if capacity is None:
        capacity = math.ceil(capacity_factor * tokens * top_k / len(probs[0]))
    keep = torch.zeros(tokens, top_k, dtype=torch.bool)
    filled = [0] * probs.shape[1]
    walk = [(t, k) for k in range(top_k) for t in range(tokens)] if order == "choice" else \
        [(t, k) for t in range(tokens) for k in range(top_k)]
    for t, k in walk:
        e = int(top_experts[t, k])
        if order == "none" or filled[e] < capacity:
            keep[t, k] = True
            filled[e] += 1
    return {"probs": probs, "experts": top_experts, "gates": gates, "keep": keep, "capacity": capacity}


def moe(router, experts, x: torch.Tensor, routing: dict) -> torch.Tensor:
    """y[t] = sum over t's kept assignments (t, e) of gate * expert_e(x[t]), expert by expert."""
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        tokens, choices = torch.nonzero(routing["keep"] & (routing["experts"] == e), as_tuple=True)
        if len(tokens):
            y = y.index_add(0, tokens, routing["gates"][tokens, choices, None] * expert(x[tokens]))
    return y


def aux_loss(routing: dict, counts: torch.Tensor | None = None) -> torch.Tensor:
    """E * sum_i f_i * P_i: f_i the fraction of the choices that picked expert i (``counts``: another
    count of choices, e.g. every rank's), P_i the mean probability of expert i."""
    probs, chosen = routing["probs"], routing["experts"]
    num_experts = probs.shape[1]
    if counts is None:
        counts = torch.bincount(chosen.flatten(), minlength=num_experts)
    fraction = counts.to(probs.dtype) / counts.sum()
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def expected_run(scenario: str, world_size: int) -> dict:
    """Every rank's y, aux_loss and gradients (x, its router's, the experts' summed over ranks), the
    routing, and the rows each rank sends to other ranks."""
    data = build(scenario, world_size)
    capacity_factor = SCENARIOS[scenario][0]
    experts = data["experts"]
    ranks = []
    for rank in range(world_size):
        router = copy.deepcopy(data["router"])  # each rank's replica gets the gradients of its tokens alone
        x = data["x"][rank].clone().requires_grad_(True)
        routing = route(router, x, TOP_K, capacity_factor)
        y = moe(router, experts, x, routing)
        aux = aux_loss(routing)
        ((y * data["g"][rank]).sum() + AUX_WEIGHT * aux).backward()
        ranks.append({"output": y.detach(), "aux": aux.detach(), "x": x.grad,
                      "router": [p.grad for p in router.parameters()], "routing": _detached(routing)})
    expert_grads = {i: [p.grad if p.grad is not None else torch.zeros_like(p) for p in e.parameters()]
                    for i, e in enumerate(experts)}
    return {"ranks": ranks, "experts": expert_grads, "rows": routed_rows(ranks, world_size)}


def _detached(routing: dict) -> dict:
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in routing.items()}


def routed_rows(ranks: list[dict], world_size: int) -> list[dict]:
    """Per rank: the kept assignments it sends to other ranks' experts ("out"), those other ranks send to
    its experts ("in"), and the same counted once per (token, destination rank) ("out_pairs", "in_pairs")."""
    out = [{"out": 0, "in": 0, "out_pairs": 0, "in_pairs": 0, "dropped": 0} for _ in range(world_size)]
    for rank, r in enumerate(ranks):
        routing = r["routing"]
        out[rank]["dropped"] = int((~routing["keep"]).sum())
        for t in range(routing["experts"].shape[0]):
            destinations = set()
            for k in range(TOP_K):
                if not routing["keep"][t, k]:
                    continue
                dest = owner(int(routing["experts"][t, k]), world_size)
                if dest != rank:
                    out[rank]["out"] += 1
                    out[dest]["in"] += 1
                    if dest not in destinations:
                        out[rank]["out_pairs"] += 1
                        out[dest]["in_pairs"] += 1
                    destinations.add(dest)
    return out


def alternatives(scenario: str, world_size: int, rank: int) -> list[tuple[str, torch.Tensor]]:
    """What a wrong y on ``rank`` may equal instead, in words."""
    data = build(scenario, world_size)
    capacity_factor = SCENARIOS[scenario][0]
    router, experts, x = data["router"], data["experts"], data["x"][rank]
    capacity = math.ceil(capacity_factor * TOKENS * TOP_K / EXPERTS)
    with torch.no_grad():
        out = [("the output with the top-k probabilities not renormalised to sum to one",
                moe(router, experts, x, route(router, x, TOP_K, capacity_factor, renormalise=False))),
               ("the output with nothing dropped: no capacity applied",
                moe(router, experts, x, route(router, x, TOP_K, capacity_factor, order="none"))),
               ("the output with the assignments taken token by token (a token's second choice before the "
                "next token's first) instead of every first choice before any second one",
                moe(router, experts, x, route(router, x, TOP_K, capacity_factor, order="token")))]
        if world_size > 1:
            out.append((f"the output with each expert taking {capacity * world_size} assignments from all ranks "
                        f"together instead of {capacity} from each sending rank",
                        _global_capacity(data, capacity_factor, rank, world_size)))
    return out


def _global_capacity(data: dict, capacity_factor: float, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s output when each expert takes W * C assignments, in rank order, then per rank as
    the statement orders them (a capacity counted over every rank's tokens, at the receiver)."""
    capacity = math.ceil(capacity_factor * TOKENS * TOP_K / EXPERTS) * world_size
    filled = [0] * EXPERTS
    mine = None
    for r in range(world_size):
        routing = route(data["router"], data["x"][r], TOP_K, capacity_factor, order="none")
        keep = torch.zeros_like(routing["keep"])
        for k in range(TOP_K):
            for t in range(TOKENS):
                e = int(routing["experts"][t, k])
                if filled[e] < capacity:
                    keep[t, k] = True
                    filled[e] += 1
        routing["keep"] = keep
        if r == rank:
            mine = moe(data["router"], data["experts"], data["x"][r], routing)
    return mine
