"""Exercise 12's verdicts: every rank's outputs, gradients, parameters, collectives and bytes held against the
dense reference (pure functions of the records)."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex12_tensor_parallel import (ATOL, BATCH, D_MODEL, HIDDEN, REFUSALS, RTOL, SEQ,
                                                     UNEVEN_CLASSES, block, uneven)
from grader.checks.ex12_tensor_parallel.reference import HELD_SLACK, SPLIT, dense_uneven, held_limit, shard
from grader.compare import tensor_difference


def _compare(got, want: torch.Tensor, name: str):
    return tensor_difference(got, want, rtol=RTOL, atol=ATOL, name=name)


def _scaled(got, want: torch.Tensor) -> str:
    """" (2.00 times the expected values)" when got is a multiple of want, else ""."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not want.abs().sum():
        return ""
    factor = float((got.double() * want.double()).sum() / (want.double() ** 2).sum())
    if abs(factor - 1) > 0.05 and torch.allclose(got.double(), factor * want.double(), rtol=1e-4, atol=1e-5):
        return f" ({factor:.2f} times the expected values)"
    return ""


def _check_output(g, check_id: str, observations: list[dict], scenario: str, want_of_rank, what: str,
                  world_size: int) -> None:
    for rank, obs in enumerate(observations):
        got = obs[scenario]["output"]
        want = want_of_rank(rank)
        found = _compare(got, want, "output")
        if found is not None:
            said = what(rank) if callable(what) else what
            g.record(check_id, False, f"rank {rank}: {said}: {found}{_scaled(got, want)}",
                     rank=rank, world_size=world_size)
            return
    g.record(check_id, True)


def _check_input_grad(g, check_id: str, observations: list[dict], scenario: str, want_of_rank, what: str,
                      world_size: int) -> None:
    for rank, obs in enumerate(observations):
        run = obs[scenario]
        if not run["backward_ran"]:
            reason = ("its output does not require grad: the graph back to the input is cut"
                      if isinstance(run["output"], torch.Tensor) else "its output is wrong (see the output check)")
            g.record(check_id, False, f"rank {rank}: {what}: no backward was run, because {reason}",
                     rank=rank, world_size=world_size)
            return
        got, want = run["input_grad"], want_of_rank(rank)
        if got is None:
            g.record(check_id, False, f"rank {rank}: {what}: the input's .grad is None after backward",
                     rank=rank, world_size=world_size)
            return
        found = _compare(got, want, "input.grad")
        if found is not None:
            g.record(check_id, False, f"rank {rank}: {what}: {found}{_scaled(got, want)}",
                     rank=rank, world_size=world_size)
            return
    g.record(check_id, True)


def check_column(g, observations: list[dict], want: dict, world_size: int) -> None:
    def output(rank):
        return want["output"][..., block(HIDDEN, rank, world_size)]

    def what(rank):
        rows = block(HIDDEN, rank, world_size)
        return (f"ColumnParallelLinear(nn.Linear({D_MODEL}, {HIDDEN})) on {world_size} ranks, against output "
                f"features {rows.start} to {rows.stop - 1} of the dense layer's output")

    _check_output(g, "column-output", observations, "column", output, what, world_size)
    _check_input_grad(g, "column-input-grad", observations, "column", lambda rank: want["input_grad"],
                      "ColumnParallelLinear's input gradient, against the dense layer's (every rank's term, "
                      "summed by an all-reduce in backward)", world_size)


def check_row(g, observations: list[dict], want: dict, world_size: int) -> None:
    _check_output(g, "row-output", observations, "row", lambda rank: want["output"],
                  f"RowParallelLinear(nn.Linear({HIDDEN}, {D_MODEL})) given this rank's block of the input, "
                  "against the dense layer's whole output", world_size)

    def input_grad(rank):
        return want["input_grad"][..., block(HIDDEN, rank, world_size)]

    _check_input_grad(g, "row-input-grad", observations, "row", input_grad,
                      "RowParallelLinear's input gradient, against this rank's block of the dense layer's",
                      world_size)


def check_mlp(g, observations: list[dict], want: dict, world_size: int) -> None:
    _check_output(g, "mlp-output", observations, "mlp", lambda rank: want["output"],
                  f"ParallelMLP (fc1 {D_MODEL}->{HIDDEN}, GELU, fc2 {HIDDEN}->{D_MODEL}), against the dense "
                  "MLP's output", world_size)
    _check_input_grad(g, "mlp-input-grad", observations, "mlp", lambda rank: want["input_grad"],
                      "ParallelMLP's input gradient, against the dense MLP's", world_size)


def _parameter_problem(params: dict, path: str, want_value: torch.Tensor, want_grad: torch.Tensor,
                       owner: str, against: str = "its block of the dense gradient") -> str | None:
    entry = params.get(path, {"missing": True})
    if entry["missing"]:
        return f"{owner}.{path} does not exist (the statement names it)"
    if "grad" not in entry:
        return f"{owner}.{path} is {entry['value']}, not a tensor"
    found = tensor_difference(entry["value"], want_value, name=f"{owner}.{path}")
    if found is not None and found.reason == "shape":
        return f"{owner}.{path} has shape {found.got}; its block of the dense layer's has {found.expected}"
    if not entry.get("in_parameters", True):
        return (f"{owner}.{path} is not among {owner}.parameters(), so an optimizer would never update it "
                "(assign an nn.Parameter)")
    if entry["grad"] is None:
        return f"{owner}.{path}.grad is None after backward"
    found = _compare(entry["grad"], want_grad, f"{owner}.{path}.grad")
    if found is not None:
        return f"{found}{_scaled(entry['grad'], want_grad)}, against {against}"
    return None


def check_weight_grads(g, observations: list[dict], expected: dict, world_size: int) -> None:
    owners = {"mlp": "ParallelMLP", "column": "ColumnParallelLinear", "row": "RowParallelLinear"}
    for scenario, owner in owners.items():
        for rank, obs in enumerate(observations):
            run = obs[scenario]
            if not run["backward_ran"]:
                g.record("weight-grads", False, f"rank {rank}: {owner}: no backward was run (see the output checks)",
                         rank=rank, world_size=world_size)
                return
            for path, dim in SPLIT[scenario].items():
                want_value = shard(expected[scenario]["values"][path], dim, rank, world_size)
                want_grad = shard(expected[scenario]["grads"][path], dim, rank, world_size)
                against = "the whole dense gradient" if dim is None else f"rank {rank}'s block of the dense gradient"
                problem = _parameter_problem(run["params"], path, want_value, want_grad, owner, against)
                if problem is not None:
                    g.record("weight-grads", False, f"rank {rank}: {problem}", rank=rank, world_size=world_size)
                    return
    g.record("weight-grads", True)


def _describe_events(events: list[dict]) -> str:
    return ", ".join(f"{e['op']} of {e['bytes']} bytes" for e in events) or "none"


def check_collectives(g, observations: list[dict], world_size: int) -> None:
    activation = BATCH * SEQ * D_MODEL * 4  # float32
    for check_id, phase, what in (("forward-one-all-reduce", "forward", "the output"),
                                  ("backward-one-all-reduce", "backward", "the input's gradient")):
        for rank, obs in enumerate(observations):
            run = obs["mlp"]
            if phase == "backward" and not run["backward_ran"]:
                g.record(check_id, False, f"rank {rank}: no backward was run (see mlp-output)",
                         rank=rank, world_size=world_size)
                break
            events = run[f"{phase}_events"]
            ok = len(events) == 1 and events[0]["op"] == "all_reduce" and events[0]["bytes"] == activation
            ok = ok or (world_size == 1 and not events)  # one rank: skipping the all-reduce is right too
            if not ok:
                g.record(check_id, False,
                         f"rank {rank}: ParallelMLP's {phase} made {len(events)} collective call(s): "
                         f"{_describe_events(events)}; expected one all_reduce of {what}, {BATCH}x{SEQ}x{D_MODEL} "
                         f"float32 = {activation} bytes", rank=rank, world_size=world_size)
                break
        g.record(check_id, True)


def check_held(g, observations: list[dict], want: dict, world_size: int) -> None:
    share, full = held_limit(want, world_size)
    for rank, obs in enumerate(observations):
        held = obs["mlp"]["held_bytes"]
        g.record("weights-sharded", held <= share + HELD_SLACK,
                 f"rank {rank}: its ParallelMLP holds {held} bytes of tensors; the dense MLP's weights and biases "
                 f"are {full}, and a 1/{world_size} share (fc2's bias whole) is {share}, {HELD_SLACK} more allowed. "
                 "A slice of a full weight "
                 "is a view that keeps all of its storage: keep copies (.clone()), and no reference to the full "
                 "layers",
                 rank=rank, world_size=world_size)
    total = sum(o["mlp"]["held_bytes"] for o in observations)
    g.record("weights-sharded", total >= full,
             f"the ranks' ParallelMLPs together hold {total} bytes, less than the dense MLP's {full}: some "
             "weights are on no rank", world_size=world_size)


def check_no_bias(g, observations: list[dict], want: dict, world_size: int) -> None:
    for rank, obs in enumerate(observations):
        run = obs["no_bias"]
        if run.get("error"):
            g.record("bias-false", False, f"rank {rank}: {run['error']}", rank=rank, world_size=world_size)
            return
        problems = []
        found = _compare(run["output"], want["output"], "output")
        if found is not None:
            problems.append(f"the output: {found}")
        elif not run["backward_ran"]:
            problems.append("no backward was run")
        else:
            found = _compare(run["input_grad"], want["input_grad"], "input.grad")
            if found is not None:
                problems.append(f"the input gradient: {found}")
            for path, dim in SPLIT["no_bias"].items():
                problem = _parameter_problem(run["params"], path, shard(want["values"][path], dim, rank, world_size),
                                             shard(want["grads"][path], dim, rank, world_size), "ParallelMLP")
                if problem is not None:
                    problems.append(problem)
        for path, kind in run["biases"].items():
            problems.append(f"{path} should be None (full.bias is None), found a {kind}")
        if problems:
            g.record("bias-false", False, f"rank {rank}: with nn.Linear(..., bias=False) layers, "
                     + "; ".join(problems), rank=rank, world_size=world_size)
            return
    g.record("bias-false", True)


def check_uneven(g, observations: list[dict], world_size: int) -> str | None:
    """Each class, given a feature count the world size does not divide: a refusal at construction on
    every rank (ValueError or assert), or a result equal to the dense layer's on every rank. Anything
    else fails: an accidental exception, a refusal on some ranks only, a built layer that raises in
    forward, or one that computes a wrong result without a word (the danger). Returns what each class
    did, in words, when every class passed."""
    if world_size < 2:
        g.skip("uneven-refused", "one rank: every feature count is divisible by 1")
        return None
    n = uneven(world_size)
    want = dense_uneven(world_size)
    did = []
    for name in UNEVEN_CLASSES:
        seen = [obs["uneven"][name] for obs in observations]
        ok, message, rank, what = _uneven_verdict(name, seen, want[name], n, world_size)
        if not ok:
            g.record("uneven-refused", False, message, rank=rank, world_size=world_size)
            return None
        did.append((name, what))
    g.record("uneven-refused", True)
    if len({what for _, what in did}) == 1:
        return f"{world_size} ranks, {n} features: every class {did[0][1]}"
    return f"{world_size} ranks, {n} features: " + "; ".join(f"{name} {what}" for name, what in did)


UNEVEN_CALLS = {"ColumnParallelLinear": "ColumnParallelLinear(nn.Linear({d}, {n}))",
                "RowParallelLinear": "RowParallelLinear(nn.Linear({n}, {d}))",
                "ParallelMLP": "ParallelMLP(nn.Linear({d}, {n}), nn.Linear({n}, {d}))"}
EITHER = ("refuse such a split in __init__ on every rank (a ValueError, or an assert, saying {n} features do not "
          "split over {w} ranks), or split it so that every rank's result is right")


def _uneven_verdict(name: str, seen: list[dict], want: dict, n: int, world_size: int
                    ) -> tuple[bool, str, int | None, str]:
    """(ok, message, rank, what the class did in words) for one class on the uneven split."""
    call = UNEVEN_CALLS[name].format(d=D_MODEL, n=n) + f" on {world_size} ranks"
    either = EITHER.format(n=n, w=world_size)

    def fail(rank: int | None, message: str) -> tuple[bool, str, int | None, str]:
        return False, message, rank, ""

    refused = [r for r, s in enumerate(seen) if s["raised"]]
    if refused and len(refused) < world_size:
        built = next(r for r, s in enumerate(seen) if not s["raised"])
        r = refused[0]
        return fail(r, f"rank {r}: {call} raised {seen[r]['raised']}: {seen[r]['message']!r}, but rank {built} built "
                    f"it: a split is refused on every rank or on none (decide from {n} and the world size alone)")
    if refused:
        accident = next((r for r in refused if seen[r]["raised"] not in REFUSALS), None)
        if accident is not None:
            s = seen[accident]
            return fail(accident, f"rank {accident}: {call} raised {s['raised']}: {s['message']!r}, which is not a "
                        f"refusal of the split but an accident of it: {either}")
        kinds = sorted({s["raised"] for s in seen})
        return True, "", None, f"refused ({', '.join(kinds)})"
    # Built on every rank: the results must be right.
    failed = next((r for r, s in enumerate(seen) if s.get("error")), None)
    if failed is not None:
        return fail(failed, f"rank {failed}: {call} was built (the split was not refused), and then its forward or "
                    f"backward raised {seen[failed]['error']}: {either}")
    widths = seen[0].get("widths") if name != "ParallelMLP" else None
    runs = [s.get("run") for s in seen]
    if any(run is None for run in runs):
        r = next(r for r, run in enumerate(runs) if run is None)
        return fail(r, f"rank {r}: {call} was built (the split was not refused), but its weight has shape "
                    f"{seen[r].get('weight_shape')}, so the grader cannot tell which of the {n} features it holds "
                    f"(the statement's shapes: {_uneven_shape(name, n)}): {either}")
    blocks = widths
    if name == "ParallelMLP":  # fc1's weight rows: the hidden features each rank holds
        shapes = [s.get("weight_shape") for s in seen]
        blocks = [shape[0] for shape in shapes] if all(shape and len(shape) == 2 for shape in shapes) else None
    held = f" (the ranks hold {' + '.join(map(str, blocks))} of the {n} features)" if blocks else ""
    wrong = _uneven_wrong_result(name, runs, want, widths)
    if wrong is not None:
        r, found = wrong
        at = f"rank {r}: " if r is not None else ""
        return fail(r, f"{at}{call} was built (the split was not refused), and it computes a wrong result without "
                    f"an error: {found}{held}. {either[0].upper()}{either[1:]}")
    split = f"split {' + '.join(map(str, blocks))}" if blocks else "split unevenly"
    return True, "", None, f"{split}, results right on every rank"


def _uneven_shape(name: str, n: int) -> str:
    if name == "RowParallelLinear":
        return f"({D_MODEL}, this rank's share of {n})"
    return f"(this rank's share of {n}, {D_MODEL})"


def _uneven_wrong_result(name: str, runs: list[dict], want: dict, widths: list[int] | None
                         ) -> tuple[int | None, str] | None:
    """(rank, what differs) for the first wrong output or input gradient, or None when all are right."""
    if name == "ColumnParallelLinear":
        outputs = [run["output"] for run in runs]
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            r = next(r for r, o in enumerate(outputs) if not isinstance(o, torch.Tensor))
            return r, f"it returned {outputs[r]}, not a tensor"
        if sum(widths) != want["output"].shape[-1]:
            more = sum(widths) > want["output"].shape[-1]
            return None, (f"the ranks' output blocks together have {sum(widths)} features, the dense layer's "
                          f"{want['output'].shape[-1]}: " + ("some features are on two ranks" if more else
                                                               "some features are on no rank"))
        found = _compare(torch.cat(outputs, dim=-1) if len({o.shape[:-1] for o in outputs}) == 1 else outputs[0],
                         want["output"], "the ranks' output blocks put together in rank order")
        if found is not None:
            return None, str(found)
    for r, run in enumerate(runs):
        if name != "ColumnParallelLinear":
            found = _compare(run["output"], want["output"], "output")
            if found is not None:
                return r, str(found)
        want_grad = want["input_grad"]
        if name == "RowParallelLinear":
            start = sum(widths[:r])
            want_grad = want_grad[..., start:start + widths[r]]
        if not run["backward_ran"]:
            return r, "no backward could be run (the output is not a tensor of the expected shape that requires grad)"
        found = _compare(run["input_grad"], want_grad, "input.grad")
        if found is not None:
            return r, str(found)
    return None
