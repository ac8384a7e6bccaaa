"""Exercise 17's verdicts: outputs, auxiliary loss, gradients, capacity, sharding, all-to-alls and routed
bytes, bad input (pure functions of the records)."""

from __future__ import annotations

import math

import torch

from grader.rank.drivers.ex17_expert_parallel import (ALL_TO_ALLS, ATOL, AUX_WEIGHT, D, EXPERTS, HELD_SLACK, REFUSALS,
                                                     RTOL, SCENARIOS, SKEWED_EXPERT, TOKENS, TOP_K, bad_experts,
                                                     build, owner)
from grader.checks.ex17_expert_parallel.reference import alternatives, aux_loss, expert_bytes, route, router_bytes
from grader.compare import tensor_difference

INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "bool")

def explain_output(got, scenario: str, world_size: int, rank: int) -> str:
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (TOKENS, D):
        return ""
    for words, value in alternatives(scenario, world_size, rank):
        # At the check's own tolerance (_compare's), never looser: else a result the check would pass matches.
        if torch.allclose(got.double(), value, rtol=RTOL, atol=ATOL * max(float(value.abs().max()), 1.0)):
            return f"; it equals {words}"
    return ""


def explain_aux(got, scenario: str, world_size: int, rank: int, want: dict) -> str:
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        return ""
    data = build(scenario, world_size)
    capacity_factor = SCENARIOS[scenario][0]
    with torch.no_grad():
        routings = [route(data["router"], x, TOP_K, capacity_factor) for x in data["x"]]
        every = sum(torch.bincount(r["experts"].flatten(), minlength=EXPERTS) for r in routings)
        mine = routings[rank]
        kept = torch.bincount(mine["experts"][mine["keep"]], minlength=EXPERTS)
        firsts = torch.bincount(mine["experts"][:, 0], minlength=EXPERTS)
        candidates = [("f counted over every rank's choices (all-reduced) instead of this rank's",
                       aux_loss(mine, every)),
                      ("f counted over the kept assignments only (after dropping)", aux_loss(mine, kept)),
                      ("f counted from the first choices only", aux_loss(mine, firsts)),
                      (f"the loss without the factor E = {EXPERTS}", aux_loss(mine) / EXPERTS),
                      (f"f divided by the tokens only, not tokens * top_k (the loss {TOP_K} times too large)",
                       aux_loss(mine) * TOP_K)]
    for words, value in candidates:
        if abs(float(got) - float(value)) <= 1e-9 * max(1.0, abs(float(value))):
            return f"; it equals {words}"
    return ""


# --- comparing ---------------------------------------------------------------------------------


def _compare(got, want: torch.Tensor, name: str):
    scale = float(want.abs().max()) if want.numel() else 1.0
    return tensor_difference(got, want, rtol=RTOL, atol=ATOL * max(scale, 1.0), name=name)


def _scenario_run(obs: dict, scenario: str) -> tuple[dict | None, str | None]:
    run = obs.get(scenario)
    if run is None:
        return None, "this scenario was not run (an earlier one failed)"
    if run.get("error"):
        return None, f"it raised {run['error']}"
    return run, None


def _returned_problem(run: dict) -> str | None:
    if run.get("returned") != "pair":
        return f"forward returned a {run.get('returned')}, not the pair (y, aux_loss)"
    return None


def _output_problem(run: dict, want: dict) -> str | None:
    problem = _returned_problem(run)
    if problem is None:
        found = _compare(run["output"], want["output"], "y")
        problem = None if found is None else str(found)
    return problem


def check_output(g, observations: list[dict], expected: dict, world_size: int) -> None:
    for rank, obs in enumerate(observations):
        run = obs["plain"]
        problem = _output_problem(run, expected["ranks"][rank])
        if problem is not None:
            g.record("output-matches", False,
                     f"world size {world_size}, rank {rank} (a random router, capacity for every token): {problem}, "
                     f"against the same layer computed in one process{explain_output(run.get('output'), 'plain', world_size, rank)}",
                     rank=rank, world_size=world_size)
            return
    g.record("output-matches", True)


def check_aux(g, observations: list[dict], expected: dict, world_size: int) -> None:
    for scenario in SCENARIOS:
        for rank, obs in enumerate(observations):
            run, failed = _scenario_run(obs, scenario)
            if run is None:
                continue  # a scenario that failed is decided by its own check
            problem = _returned_problem(run)
            want = expected[scenario]["ranks"][rank]["aux"]
            got = run.get("aux")
            if problem is None and (not isinstance(got, torch.Tensor) or got.numel() != 1):
                problem = f"aux_loss is {got if not isinstance(got, torch.Tensor) else list(got.shape)}, not a scalar"
            if problem is None:
                found = _compare(got.reshape(()), want, "aux_loss")
                problem = None if found is None else str(found) + explain_aux(got, scenario, world_size, rank, want)
            if problem is not None:
                g.record("aux-loss-matches", False,
                         f"world size {world_size}, rank {rank} ({_said(scenario)}): {problem}; the Switch loss over "
                         f"this rank's {TOKENS} tokens is E * sum_i f_i * P_i = {float(want):.12g}",
                         rank=rank, world_size=world_size)
                return
    g.record("aux-loss-matches", True)


def _grads_problem(run: dict, want: dict, rank: int, world_size: int) -> str | None:
    if not run.get("backward_ran"):
        return ("no backward could be run: forward did not return (y, aux_loss) with y of x's shape requiring "
                f"grad and a scalar aux_loss (y is {_describe(run.get('output'))}, aux_loss {_describe(run.get('aux'))})")
    grads = run["grads"]
    mine = want["ranks"][rank]
    if grads["x"] is None:
        return "x.grad is None after backward: y does not depend on x through autograd (an all-to-all without autograd?)"
    found = _compare(grads["x"], mine["x"], "x.grad")
    if found is not None:
        return str(found)
    for name, got, expect in zip(("router.weight", "router.bias"), grads["router"], mine["router"]):
        if got is None:
            return f"{name}.grad is None after backward"
        found = _compare(got, expect, f"{name}.grad")
        if found is not None:
            return f"{found} (the router's gradient comes from this rank's tokens alone)"
    for expert, got_list in sorted(grads["experts"].items()):
        for index, (got, expect) in enumerate(zip(got_list, want["experts"][expert])):
            name = f"expert {expert}'s parameter {index}"
            if got is None:
                if not expect.abs().max():
                    continue  # no token reached this expert: no gradient is right too
                return (f"{name} has no .grad on its owner, rank {rank}: run the given expert modules themselves "
                        "(not copies), and let the gradients come back through the all-to-alls")
            found = _compare(got, expect, f"{name}.grad")
            if found is not None:
                return f"{found} (an expert's gradient sums every rank's tokens that reached it)"
    return None


def _describe(value) -> str:
    return f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else str(value)


def check_grads(g, observations: list[dict], expected: dict, world_size: int) -> None:
    for rank, obs in enumerate(observations):
        problem = _grads_problem(obs["plain"], expected, rank, world_size)
        if problem is not None:
            g.record("grads-match", False,
                     f"world size {world_size}, rank {rank}: after backward of sum(y * G) + {AUX_WEIGHT} * aux_loss, "
                     f"{problem}, against the same layer computed in one process", rank=rank, world_size=world_size)
            return
    g.record("grads-match", True)


def _said(scenario: str) -> str:
    capacity_factor, bias = SCENARIOS[scenario]
    capacity = math.ceil(capacity_factor * TOKENS * TOP_K / EXPERTS)
    if scenario == "plain":
        return f"a random router, capacity_factor {capacity_factor:g}: capacity {capacity}, nothing dropped"
    if scenario == "tight":
        return f"a random router, capacity_factor {capacity_factor:g}: capacity {capacity} per expert and sending rank"
    return (f"a router biased towards expert {SKEWED_EXPERT}, capacity_factor {capacity_factor:g}: capacity "
            f"{capacity} per expert and sending rank")


def check_capacity(g, observations: list[dict], expected: dict, world_size: int, scenario: str,
                   check_id: str) -> None:
    """The output and gradients of a scenario where some assignments are dropped."""
    for rank, obs in enumerate(observations):
        run, failed = _scenario_run(obs, scenario)
        if run is None and obs.get(scenario) is None and scenario == "skewed":
            g.not_checked(check_id, "capacity-order", "not run: the scenario before it failed", world_size=world_size)
            return
        if run is None:
            g.record(check_id, False, f"world size {world_size}, rank {rank} ({_said(scenario)}): {failed}",
                     rank=rank, world_size=world_size)
            return
        want = expected["ranks"][rank]
        problem = _output_problem(run, want)
        if problem is not None:
            problem = f"y: {problem}{explain_output(run.get('output'), scenario, world_size, rank)}"
        else:
            grads = _grads_problem(run, expected, rank, world_size)
            problem = None if grads is None else f"the gradients: {grads}"
        if problem is not None:
            routing = want["routing"]
            dropped = int((~routing["keep"]).sum())
            firsts = int((~routing["keep"][:, 0]).sum())
            g.record(check_id, False,
                     f"world size {world_size}, rank {rank} ({_said(scenario)}): {problem}. Of this rank's "
                     f"{TOKENS} x {TOP_K} assignments the rule drops {dropped} ({firsts} of them first choices)",
                     rank=rank, world_size=world_size)
            return
    g.record(check_id, True)


def check_sharded(g, observations: list[dict], world_size: int) -> None:
    per_rank = EXPERTS // world_size
    for rank, obs in enumerate(observations):
        mine = set(range(rank * per_rank, (rank + 1) * per_rank))
        allowed = 2 * (router_bytes() + per_rank * expert_bytes()) + HELD_SLACK  # the values and their .grad
        for when, held in (("after __init__", obs["plain"].get("held")),
                           ("after forward and backward", obs["plain"].get("held_after"))):
            if not held:
                continue
            others = [e for e in held["experts"] if e not in mine]
            if others:
                g.record("experts-sharded", False,
                         f"world size {world_size}, rank {rank}, {when}: the module holds the weights of expert(s) "
                         f"{', '.join(map(str, others))}, which rank(s) {', '.join(str(owner(e, world_size)) for e in others)} "
                         f"own (found byte for byte in the storages reachable from it); rank {rank} owns experts "
                         f"{min(mine)}-{max(mine)} only", rank=rank, world_size=world_size)
                return
            if held["bytes"] > allowed:
                g.record("experts-sharded", False,
                         f"world size {world_size}, rank {rank}, {when}: the module holds {held['bytes']} bytes of "
                         f"tensors; the router and its {per_rank} experts with their gradients are "
                         f"{allowed - HELD_SLACK}, {HELD_SLACK} more allowed", rank=rank, world_size=world_size)
                return
        held = obs["plain"].get("held") or {"experts": []}
        missing = sorted(mine - set(held["experts"]))
        if missing:
            g.record("experts-sharded", False,
                     f"world size {world_size}, rank {rank}: the module does not hold expert(s) "
                     f"{', '.join(map(str, missing))}, which rank {rank} owns: keep the given modules of experts "
                     f"{min(mine)}-{max(mine)} (in an nn.ModuleList)", rank=rank, world_size=world_size)
            return
    g.record("experts-sharded", True)


def data_messages(events: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(float all-to-alls, other messages with floating-point data, integer messages)."""
    a2a, other_float, integer = [], [], []
    for e in events:
        if e["dtype"] in INTEGERS or (e["dtype"] is None and not e["bytes"]):
            integer.append(e)
        elif e["op"] in ALL_TO_ALLS:
            a2a.append(e)
        else:
            other_float.append(e)
    return a2a, other_float, integer


def _integer_limit(world_size: int) -> int:
    """Bytes of integers a rank may exchange per pass: counts per expert, and an expert id per choice."""
    return 8 * world_size * (EXPERTS + TOKENS * TOP_K)


def _name(e: dict) -> str:
    names = {"alltoall_base_": "all_to_all_single", "alltoall_": "all_to_all", "allgather_": "all_gather",
             "_allgather_base_": "all_gather_into_tensor", "allreduce_": "all_reduce", "broadcast_": "broadcast",
             "send": "send", "recv_": "recv", "reduce_scatter_": "reduce_scatter"}
    return names.get(e["op"], e["op"])


def check_all_to_all_count(g, observations: list[dict], world_size: int) -> None:
    for scenario in SCENARIOS:
        for rank, obs in enumerate(observations):
            run, _ = _scenario_run(obs, scenario)
            if run is None or _returned_problem(run):
                continue
            for phase in ("forward", "backward"):
                if phase == "backward" and not run.get("backward_ran"):
                    continue
                a2a, other_float, integer = data_messages(run[f"{phase}_events"])
                problem = None
                if other_float:
                    e = other_float[0]
                    problem = (f"a {_name(e)} of {e['bytes']} bytes of {e['dtype']}: tokens, outputs and their "
                               "gradients travel by all-to-all only")
                elif len(a2a) != 2:
                    problem = (f"{len(a2a)} all-to-all(s) of floating-point data; "
                               + ("forward sends the rows to their experts' ranks and brings the outputs back: two"
                                  if phase == "forward" else
                                  "backward brings the gradients of the outputs to the experts and those of the "
                                  "rows back: two, one per forward all-to-all (is the all-to-all differentiable?)"))
                elif sum(e["bytes"] for e in integer) > _integer_limit(world_size):
                    problem = (f"{len(integer)} exchange(s) of integers, {sum(e['bytes'] for e in integer)} bytes; "
                               f"the counts (and an expert id per choice) are at most {_integer_limit(world_size)}")
                if problem is not None:
                    g.record("all-to-all-count", False,
                             f"world size {world_size}, rank {rank}, {phase} ({_said(scenario)}): {problem}",
                             rank=rank, world_size=world_size)
                    return
    g.record("all-to-all-count", True)


def check_routed_bytes(g, observations: list[dict], expected: dict, world_size: int) -> None:
    """Each float all-to-all sends to other ranks exactly the rows of the kept assignments that cross
    ranks (or those rows once per token and destination rank)."""
    row = D * 8
    for scenario in SCENARIOS:
        for rank, obs in enumerate(observations):
            run, _ = _scenario_run(obs, scenario)
            if run is None or _returned_problem(run):
                continue
            rows = expected[scenario]["rows"][rank]
            for phase in ("forward", "backward"):
                if phase == "backward" and not run.get("backward_ran"):
                    continue
                a2a, other_float, _ = data_messages(run[f"{phase}_events"])
                sent = [e.get("off_rank") for e in a2a]
                # Forward: the rows out, the results back. Backward, in the same order: the results'
                # gradients out (to the experts' ranks), the rows' gradients back.
                want = [(rows["out"], rows["out_pairs"]), (rows["in"], rows["in_pairs"])]
                problem = None
                if other_float:
                    e = other_float[0]
                    problem = f"a {_name(e)} of {e['bytes']} bytes of {e['dtype']} (every rank gets the data)"
                elif len(sent) == 2 and all(isinstance(s, int) for s in sent):
                    for which, (got, (each, pairs)) in zip(("first", "second"), zip(sent, want)):
                        if got not in (each * row, pairs * row):
                            problem = (f"its {which} all-to-all sends {got} bytes to other ranks "
                                       f"({_rows(got, row)}); the kept assignments that cross ranks are {each} "
                                       f"row(s) of {D} float64 = {each * row} bytes")
                            break
                if problem is not None:
                    g.record("routed-bytes", False,
                             f"world size {world_size}, rank {rank}, {phase} ({_said(scenario)}): {problem}. Send "
                             "each kept (token, expert) row to its expert's rank only, and nothing for a dropped one",
                             rank=rank, world_size=world_size)
                    return
    g.record("routed-bytes", True)


def _rows(total: int, row: int) -> str:
    count = total / row
    return f"{count:g} rows" if count == int(count) else f"{count:.2f} rows"


# --- bad input ----------------------------------------------------------------------------------


BAD_CASES = {
    "experts": "ExpertParallelMoE(router, {n} experts, ...) on {w} ranks ({n} not divisible by {w})",
    "columns": "forward(x) with x of shape [{t}, {d1}] (the router takes {d} features)",
    "three_d": "forward(x) with x of shape [2, {half}, {d}] (x must be [tokens, d])",
}


def check_bad_input(g, outcome, world_size: int) -> str:
    """Each bad input is refused on every rank with ValueError (or an assert) raised in the learner's code;
    returns a line for the report's section."""
    words = {case: text.format(n=bad_experts(world_size), w=world_size, t=TOKENS, d=D, d1=D + 1, half=TOKENS // 2)
             for case, text in BAD_CASES.items()}
    for rank, r in enumerate(outcome.ranks):
        if r.status != "ok":
            err = r.error or {}
            how = (f"raised {err.get('type')}: {str(err.get('message'))[:200]}" if err else
                   f"ended without a result (exit code {r.exitcode})")
            g.record("bad-input-refused", False, f"world size {world_size}: with bad input (an expert count the world "
                     f"size does not divide, tokens of the wrong shape), rank {rank}'s process {how}",
                     rank=rank, world_size=world_size)
            return ""
    results = outcome.results()
    build_error = next(((rank, res["build_error"]) for rank, res in enumerate(results) if res.get("build_error")),
                       None)
    if build_error is not None:
        rank, error = build_error
        g.record("bad-input-refused", False, f"world size {world_size}, rank {rank}: building the layer with "
                 f"{EXPERTS} experts (after the bad expert count) raised {error}", rank=rank, world_size=world_size)
        return ""
    said = []
    for case, text in words.items():
        seen = [res.get(case) for res in results]
        problem = None
        for rank, s in enumerate(seen):
            if s is None:
                problem = rank, "not run"
            elif not s["raised"]:
                problem = rank, ("it was accepted without an error" + (f" (y of shape {s['shape']})"
                                                                       if s.get("shape") else ""))
            elif s["raised"] not in REFUSALS:
                problem = rank, (f"it raised {s['raised']}: {s['message']!r} (in {s.get('where')}), an accident of the "
                                 "input rather than a refusal of it")
            if problem is not None:
                break
        if problem is not None:
            rank, what = problem
            g.record("bad-input-refused", False,
                     f"world size {world_size}, rank {rank}: {text}: {what}. Check the input first and raise "
                     "ValueError saying what is wrong, on every rank, before any message",
                     rank=rank, world_size=world_size)
            return ""
        said.append(f"{text}: {seen[0]['raised']}: {seen[0]['message'][:120]}")
    g.record("bad-input-refused", True)
    return "bad input, as refused on rank 0: " + "; ".join(said)
