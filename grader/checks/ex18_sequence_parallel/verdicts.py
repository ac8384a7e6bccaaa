"""Exercise 18's verdicts: outputs, gradients, slices and replicated parameters, the second step, saved
tensors, bytes held, groups, collectives and bad input (pure functions of the records)."""

from __future__ import annotations

import torch

from grader.rank import probes
from grader.rank.drivers.ex18_sequence_parallel import (ATOL, BATCH, D_MODEL, NORM_EPS, REFUSALS, REPLICATED, RTOL,
                                                       SPLIT, chunk_elements, chunk_rows, groups_of, hidden_block,
                                                       sizes, uneven_hidden, uneven_lengths)
from grader.checks.ex18_sequence_parallel.reference import (classify_saved, hidden_of, outside_bytes_dense, own_term,
                                                            reference, seq_of, share_of, whole_of)
from grader.compare import tensor_difference

HELD_SLACK = 256  # bytes of small tensors a block may keep besides its parameters (a flag, an index)
AGREE_RTOL = 1e-12  # replicated gradients after an all-reduce are the same numbers on every rank


# --- comparing ----------------------------------------------------------------------------------


def _compare(got, want: torch.Tensor, name: str):
    scale = float(want.abs().max()) if want.numel() else 1.0
    return tensor_difference(got, want, rtol=RTOL, atol=ATOL * max(scale, 1.0), name=name)


def _close(got, want: torch.Tensor) -> bool:
    """Whether ``got`` equals ``want`` within the checks' own tolerance (_compare's), never looser: an "it equals
    ..." diagnosis must not match what the check itself would have passed."""
    return isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape) and \
        torch.allclose(got.double(), want.double(), rtol=RTOL, atol=ATOL * max(float(want.abs().max()), 1.0))


def explain_output(got, rank: int, world_size: int) -> str:
    """What a wrong output equals instead, when it equals something recognisable."""
    if not isinstance(got, torch.Tensor):
        return ""
    rows = chunk_rows(rank, world_size, sizes(world_size)[0])
    whole = reference("main", world_size)
    want, bias, x = whole["output"][rows], whole["values"]["fc2.bias"], whole["x"][rows]
    default_eps = reference("main", world_size, eps=1e-5)["output"][rows]
    candidates = [
        (f"the dense output with LayerNorm's default eps 1e-5, not the norm's eps ({NORM_EPS:g}): take eps from the "
         "norm given to the block (norm.eps)", default_eps),
        (f"the dense output with fc2's bias counted {world_size} times, not once: each rank added it to its term "
         "before the reduce-scatter", want + (world_size - 1) * bias),
        ("the dense output without the residual x", want - x),
        ("the dense output without fc2's bias", want - bias),
        ("this rank's own hidden block's term alone: the terms were never summed across ranks",
         own_term(rank, world_size)["output"][rows]),
    ]
    for words, value in candidates:
        if _close(got, value) and not _close(value, want):  # a candidate that is the right answer explains nothing
            return f"; it equals {words}"
    return ""


def check_output(g, observations: list[dict], want: dict, world_size: int) -> bool:
    for rank, obs in enumerate(observations):
        got = obs["main"]["output"]
        found = _compare(got, want["output"][chunk_rows(rank, world_size, seq_of(want))], "output")
        if found is not None:
            return g.record("output-matches", False,
                            f"{_where(rank, world_size)}: the output is not this rank's chunk of the dense block's "
                            f"x + fc2(gelu(fc1(norm(x)))): {found}{explain_output(got, rank, world_size)}",
                            rank=rank, world_size=world_size)
    return g.record("output-matches", True)


def check_input_grad(g, observations: list[dict], want: dict, world_size: int) -> bool:
    for rank, obs in enumerate(observations):
        run = obs["main"]
        rows = chunk_rows(rank, world_size, seq_of(want))
        if not run["backward_ran"]:
            problem = _no_backward(run)
        elif run["input_grad"] is None:
            problem = "x.grad is None after backward: the output does not depend on x through autograd"
        else:
            found = _compare(run["input_grad"], want["x_grad"][rows], "x.grad")
            problem = None if found is None else f"{found}, against this rank's chunk of the dense x.grad"
            if found is not None:
                own = own_term(rank, world_size)["x_grad"][rows]
                if _close(run["input_grad"], own):
                    problem += ("; it holds only this rank's own hidden block's term: in backward the all-gather's "
                                "gradient must be summed over the ranks and scattered (a reduce-scatter), not sliced")
        if problem is not None:
            return g.record("input-grad-matches", False, f"{_where(rank, world_size)}: after backward of "
                            f"sum(output * G), {problem}", rank=rank, world_size=world_size)
    return g.record("input-grad-matches", True)


# --- parameters, found by their values ----------------------------------------------------------


def find_parameter(params: list[dict], value: torch.Tensor) -> tuple[dict | None, bool]:
    """The parameter holding ``value`` (exactly, or transposed for a matrix), and whether transposed."""
    for p in params:
        got = p["value"]
        if not isinstance(got, torch.Tensor):
            continue
        if tuple(got.shape) == tuple(value.shape) and torch.equal(got.double(), value.double()):
            return p, False
        if value.dim() == 2 and tuple(got.shape) == tuple(value.T.shape) and torch.equal(got.double().T,
                                                                                             value.double()):
            return p, True
    return None, False


def _listing(params: list[dict]) -> str:
    return ", ".join(f"{p['name']} {list(p['value'].shape) if isinstance(p['value'], torch.Tensor) else '?'}"
                     for p in params) or "none"


def _what(name: str, rank: int, world_size: int, hidden: int) -> str:
    if name in REPLICATED:
        return f"the whole {name}"
    block = hidden_block(rank, world_size, hidden)
    part = "rows" if SPLIT[name] == 0 else "columns"
    return f"{part} {block.start}-{block.stop - 1} of {name}"


def parameter_problem(params: list[dict], name: str, want: dict, rank: int,
                      world_size: int) -> tuple[str, dict | None]:
    """(what is wrong, the parameter found) for one of the block's parameters; ("", p) when right."""
    hidden = hidden_of(want)
    value = share_of(want, name, rank, world_size, "values")
    p, transposed = find_parameter(params, value)
    if p is None:
        return (f"no parameter of the block holds {_what(name, rank, world_size, hidden)} (shape "
                f"{list(value.shape)}); its parameters: {_listing(params)}"), None
    grad = p["grad"]
    if grad is None:
        return f"{p['name']} (holding {_what(name, rank, world_size, hidden)}) has no .grad after backward", p
    if transposed and isinstance(grad, torch.Tensor):
        grad = grad.T
    found = _compare(grad, share_of(want, name, rank, world_size, "grads"), f"{p['name']}.grad")
    if found is not None:
        return f"{found}, against the dense gradient of {_what(name, rank, world_size, hidden)}", p
    return "", p


def check_slices(g, observations: list[dict], want: dict, world_size: int) -> bool:
    for rank, obs in enumerate(observations):
        run = obs["main"]
        if not run["backward_ran"]:
            return g.record("slice-grads-match", False, f"{_where(rank, world_size)}: {_no_backward(run)}",
                            rank=rank, world_size=world_size)
        for name in SPLIT:
            problem, _ = parameter_problem(run["params"], name, want, rank, world_size)
            if problem:
                return g.record("slice-grads-match", False, f"{_where(rank, world_size)}: {problem}",
                                rank=rank, world_size=world_size)
    return g.record("slice-grads-match", True)


def check_replicated(g, observations: list[dict], want: dict, world_size: int) -> bool:
    """Each replicated parameter: its gradient the same on every rank (agree), and the dense one (match)."""
    grads: dict[str, list] = {name: [] for name in REPLICATED}
    match_problem = None
    for rank, obs in enumerate(observations):
        run = obs["main"]
        if not run["backward_ran"]:
            match_problem = match_problem or (rank, _no_backward(run))
            continue
        for name in REPLICATED:
            problem, p = parameter_problem(run["params"], name, want, rank, world_size)
            if problem and match_problem is None:
                wrong = p is not None and isinstance(p["grad"], torch.Tensor)
                if wrong and _close(p["grad"], want["grads"][name] / world_size):
                    problem += f"; it is 1/{world_size} of it: the ranks' gradients were averaged, not summed"
                match_problem = (rank, problem)
            grads[name].append(None if p is None else p["grad"])
    agree_problem = None
    for name, per_rank in grads.items():
        if len(per_rank) < 2 or any(not isinstance(t, torch.Tensor) for t in per_rank):
            continue
        for rank, grad in enumerate(per_rank[1:], start=1):
            found = tensor_difference(grad, per_rank[0], rtol=AGREE_RTOL, atol=AGREE_RTOL, name=f"{name}.grad")
            if found is not None:
                agree_problem = (rank, f"the gradient of {name} (replicated: the whole of it on every rank) differs "
                                       f"from rank 0's: {found}. Each rank's holds only its own chunk's share of "
                                       "the sum; all-reduce it during backward")
                break
        if agree_problem:
            break
    if agree_problem:
        rank, said = agree_problem
        g.record("replicated-grads-agree", False, f"world size {world_size}, rank {rank}: {said}",
                 rank=rank, world_size=world_size)
    else:
        g.record("replicated-grads-agree", True)
    if match_problem:
        rank, said = match_problem
        return g.record("replicated-grads-match", False, f"{_where(rank, world_size)}: {said}", rank=rank,
                        world_size=world_size)
    return g.record("replicated-grads-match", True) and not agree_problem


def _times(got: torch.Tensor, first: torch.Tensor) -> int | None:
    """k when ``got`` is k times ``first`` for a whole k of 2 or more (None otherwise)."""
    scale = float(first.abs().max()) if first.numel() else 0.0
    if scale == 0.0 or tuple(got.shape) != tuple(first.shape):
        return None
    k = round(float(got.double().abs().max()) / scale)
    return k if k >= 2 and _close(got.double(), k * first.double()) else None


def second_step_problem(first: dict, second: dict | None) -> str | None:
    """What the second forward and backward gave differently from the first (None when the same)."""
    if second is None:
        return "no second step could be run"
    pairs = [("the output", first["output"], second["output"]), ("x.grad", first["input_grad"], second["input_grad"])]
    pairs += [(f"{p['name']}.grad", p["grad"], q["grad"]) for p, q in zip(first["params"], second["params"])]
    if len(first["params"]) != len(second["params"]):
        return f"the block had {len(first['params'])} parameters in the first step and {len(second['params'])} then"
    for what, one, two in pairs:
        if not isinstance(one, torch.Tensor):
            continue
        if not isinstance(two, torch.Tensor):
            return f"{what} is {_describe(two)} in the second step, a tensor in the first"
        found = tensor_difference(two, one, rtol=RTOL, atol=ATOL * max(float(one.abs().max() or 0.0), 1.0), name=what)
        if found is None:
            continue
        k = _times(two, one)
        why = (f"; it is {k} times the first step's: it was summed once more per forward so far, as when a hook that "
               "all-reduces it is registered in forward (one more each call). Register hooks once, in __init__, or "
               "put the all-reduce in an autograd Function applied in forward") if k else ""
        return f"{found}, against the first step's{why}"
    return None


def check_second_step(g, observations: list[dict], world_size: int) -> None:
    """A second forward and backward on the same block (gradients cleared between) gives what the first gave."""
    for rank, obs in enumerate(observations):
        first = obs["main"]
        if not first["backward_ran"]:
            g.record("second-step-matches", False, f"{_where(rank, world_size)}: {_no_backward(first)}",
                     rank=rank, world_size=world_size)
            return
        problem = second_step_problem(first, obs.get("second"))
        if problem is not None:
            g.record("second-step-matches", False,
                     f"{_where(rank, world_size)}: a second forward and backward of the same block on the same chunk, "
                     f"its gradients cleared between (as zero_grad does): {problem}", rank=rank, world_size=world_size)
            return
    g.record("second-step-matches", True)


def rank_saved(obs: dict, want: dict, rank: int, world_size: int) -> list[dict]:
    """What rank ``rank`` saved in the main scenario's forward, classified (classify_saved)."""
    params = [share_of(want, name, rank, world_size) for name in (*REPLICATED, *SPLIT)]
    return classify_saved(obs["main"]["saved"] or [], hidden_of(want) // world_size, whole_of(want), params)


def check_saved(g, observations: list[dict], want: dict, world_size: int) -> None:
    dense_outside = outside_bytes_dense(want)
    limit = chunk_elements(world_size)
    for rank, obs in enumerate(observations):
        entries = rank_saved(obs, want, rank, world_size)
        outside = [e for e in entries if e["kind"] == "outside"]
        total = sum(e["bytes"] for e in outside)
        too_big = [e for e in outside if e["elements"] > limit]
        if too_big:
            big = max(too_big, key=lambda e: e["elements"])
            shapes = ", ".join(str(v["shape"]) for v in big["views"][:2])
            g.record("saved-activations-sharded", False,
                     f"{_where(rank, world_size)}: outside the parallel region autograd kept a tensor of "
                     f"{big['elements']} elements ({big['bytes']} bytes, saved as {shapes}) for backward, more than "
                     f"one chunk of the activation ({seq_of(want) // world_size}x{BATCH}x{D_MODEL} = {limit}): in all "
                     f"{total} bytes outside the region, where the dense block keeps {dense_outside} and 1/{world_size}"
                     f" of that is {dense_outside // world_size} (of the model's width, only fc1's gathered input "
                     "covers the whole sequence). The norm ran on more than this rank's chunk: run it on the chunk, "
                     "and all-gather its output", rank=rank, world_size=world_size)
            return
    g.record("saved-activations-sharded", True)


def check_held(g, observations: list[dict], want: dict, world_size: int) -> None:
    sizes = {name: t.numel() * t.element_size() for name, t in want["values"].items()}
    share = sum(sizes[name] for name in REPLICATED) + sum(sizes[name] for name in SPLIT) // world_size
    full = sum(sizes.values())
    for rank, obs in enumerate(observations):
        held = obs["held_bytes"]
        if held > share + HELD_SLACK:
            g.record("weights-sharded", False,
                     f"world size {world_size}, rank {rank}: its block holds {held} bytes of tensors; the dense "
                     f"modules' weights and biases are {full}, and this rank's share (its blocks of fc1 and fc2, the "
                     f"norm and fc2's bias whole) is {share}, {HELD_SLACK} more allowed. A slice of a dense weight is "
                     "a view that keeps all of its storage: keep copies (.clone()), and no reference to the dense "
                     "modules", rank=rank, world_size=world_size)
            return
    total = sum(o["held_bytes"] for o in observations)
    g.record("weights-sharded", world_size == 1 or total >= full - HELD_SLACK,
             f"world size {world_size}: the ranks' blocks together hold {total} bytes, less than the dense "
             f"modules' {full}: some weights are on no rank", world_size=world_size)


# --- group ----------------------------------------------------------------------------------------


def check_group(g, observations: list[dict], world_size: int, main_ok: bool = True) -> None:
    """Each group's results against its own dense block. ``main_ok``: whether the block was right without
    group= in this world (if not, a wrong result here is most likely the same problem)."""
    groups = groups_of(world_size)
    advice = (". Take W and r from the group (dist.get_world_size(group), dist.get_rank(group)) and pass group= to "
              "every collective" if main_ok else ", as without group= (see the checks above)")
    for rank, obs in enumerate(observations):
        run = obs["group"]
        mine = next(i for i, members in enumerate(groups) if rank in members)
        members = groups[mine]
        said = f"world size {world_size}, rank {rank}, in group {members} with a sequence of its own"
        if run.get("error"):
            g.record("uses-group", False, f"{said}: the block raised {run['error']}", rank=rank, world_size=world_size)
            return
        want = reference("group", len(members), salt=mine)
        rows = chunk_rows(members.index(rank), len(members), seq_of(want))
        problem = _compare(run["output"], want["output"][rows], "output")
        if problem is None and run["backward_ran"]:
            problem = _compare(run["input_grad"], want["x_grad"][rows], "x.grad")
            for name in (*REPLICATED, *SPLIT):
                if problem is None:
                    problem = parameter_problem(run["params"], name, want, members.index(rank), len(members))[0]
                    problem = problem or None
        elif problem is None:
            problem = _no_backward(run)
        if problem is not None:
            g.record("uses-group", False, f"{said}: {problem}{advice}", rank=rank, world_size=world_size)
            return
    g.record("uses-group", True)


def _where(rank: int, world_size: int) -> str:
    seq = sizes(world_size)[0]
    rows = chunk_rows(rank, world_size, seq)
    return f"world size {world_size}, rank {rank} (positions {rows.start}-{rows.stop - 1} of {seq})"


def _no_backward(run: dict) -> str:
    return ("no backward could be run: the output is not a tensor of x's shape that requires grad (it is "
            f"{_describe(run['output'])})")


def _describe(value) -> str:
    return f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else str(value)


# --- messages -----------------------------------------------------------------------------------


def activation_collectives(events: list[dict], world_size: int) -> dict:
    """The collectives of one phase that carry activations (at least one chunk's bytes), by kind: "gather"
    (an all-gather), "scatter" (a reduce-scatter, or the all-to-all torch.distributed.nn emulates it with,
    W scatter calls on gloo), "other" (anything else: an all-reduce, a broadcast, a send)."""
    least = chunk_elements(world_size) * 8  # float64
    out = {"gather": [], "scatter": [], "other": []}
    scatters = []
    for e in events:
        if e["bytes"] < least:
            continue  # a few numbers (the chunks' lengths) or a replicated parameter's gradient
        if e["op"] in probes.ALL_GATHERS:
            out["gather"].append(e)
        elif e["op"] in probes.REDUCE_SCATTERS or e["op"] in ("all_to_all", "all_to_all_single"):
            out["scatter"].append(e)
        elif e["op"] == "scatter":
            scatters.append(e)
        else:
            out["other"].append(e)
    if scatters and len(scatters) % world_size == 0:  # one from each rank in turn: an all-to-all
        out["scatter"] += [{"op": f"{world_size} scatters", "bytes": sum(e["bytes"] for e in scatters)}] * (
            len(scatters) // world_size)
    else:
        out["other"] += scatters
    return out


def _describe_events(events: list[dict]) -> str:
    return ", ".join(f"{e['op']} of {e['bytes']} bytes" for e in events) or "none"


def check_collectives(g, observations: list[dict], world_size: int) -> None:
    for check_id, phase in (("forward-gather-scatter", "forward"), ("backward-gather-scatter", "backward")):
        for rank, obs in enumerate(observations):
            run = obs["main"]
            if phase == "backward" and not run["backward_ran"]:
                g.record(check_id, False, f"{_where(rank, world_size)}: {_no_backward(run)}",
                         rank=rank, world_size=world_size)
                break
            kinds = activation_collectives(run[f"{phase}_events"], world_size)
            if world_size == 1 or (len(kinds["gather"]) == 1 and len(kinds["scatter"]) == 1 and not kinds["other"]):
                continue
            said = (f"{_where(rank, world_size)}: the {phase} made {len(kinds['gather'])} all-gather(s), "
                    f"{len(kinds['scatter'])} reduce-scatter(s) and {len(kinds['other'])} other collective(s) of "
                    f"activations (every call: {_describe_events(run[f'{phase}_events'])}); expected one all-gather "
                    "and one reduce-scatter along the sequence")
            reduces = [e for e in kinds["other"] if e["op"] == "all_reduce"]
            if reduces:
                said += (f". An all-reduce of {reduces[0]['bytes']} bytes carries an activation: every rank gets the "
                         "whole sum where it needs its chunk of it (a reduce-scatter sends half the bytes)")
            g.record(check_id, False, said, rank=rank, world_size=world_size)
            break
        else:
            g.record(check_id, True)


# --- bad input ----------------------------------------------------------------------------------


def _refusal_problem(results: list[dict], what: str) -> tuple[int, str] | None:
    """None when every rank refused with ValueError (or an assert); else (rank, what happened)."""
    for rank, res in enumerate(results):
        if res.get("raised") is None:
            return rank, f"{what}: rank {rank} went on without an error"
        if res["raised"] not in REFUSALS:
            return rank, (f"{what}: rank {rank} raised {res['raised']}: {res['message']!r}, an accident of the input "
                          "rather than a refusal; check it first and raise ValueError saying what was expected")
    return None


def check_hidden(g, observations: list[dict], world_size: int) -> None:
    hidden = uneven_hidden(world_size)
    problem = _refusal_problem([o["hidden"] for o in observations],
                               f"world size {world_size}, fc1 = nn.Linear({D_MODEL}, {hidden}) and fc2 = "
                               f"nn.Linear({hidden}, {D_MODEL}), {hidden} hidden features for {world_size} ranks")
    if world_size > 1 and problem is not None:
        rank, said = problem
        g.record("hidden-not-divisible-refused", False, said + ("" if "raised" in said else
                 ": the block was built; blocks of hidden // W features leave some out"), rank=rank,
                 world_size=world_size)
        return
    g.record("hidden-not-divisible-refused", True)


def check_shape(g, observations: list[dict], world_size: int) -> None:
    results = [o["shape"] for o in observations]
    if any(not r.get("built", True) for r in results):
        rank = next(i for i, r in enumerate(results) if not r.get("built", True))
        g.record("wrong-shape-refused", False, f"world size {world_size}, rank {rank}: the block could not be built: "
                 f"{results[rank].get('error')}", rank=rank, world_size=world_size)
        return
    rows = sizes(world_size)[0] // world_size
    problem = _refusal_problem(results, f"world size {world_size}, x of shape [{rows}, {BATCH}, "
                                        f"{D_MODEL + 1}] into a block whose d is {D_MODEL}")
    if problem is not None:
        rank, said = problem
        g.record("wrong-shape-refused", False, said, rank=rank, world_size=world_size)
        return
    g.record("wrong-shape-refused", True)


def uneven_words(world_size: int, pattern: str) -> str:
    """The lengths of an uneven pattern, and why a check that only adds them up misses it."""
    lengths = uneven_lengths(world_size, pattern)
    if pattern == "sum-hides":
        chunk = sum(lengths) // world_size
        return (f"world size {world_size}, chunks of lengths {lengths} (their sum is {sum(lengths)} = {chunk} x "
                f"{world_size}: a rank holding {chunk} cannot tell from the sum that the lengths differ)")
    return f"world size {world_size}, chunks of lengths {lengths} (a sequence of {sum(lengths)} cut by tensor_split)"


def check_uneven(g, outcome, world_size: int, pattern: str = "one-longer") -> None:
    said = uneven_words(world_size, pattern)
    results = [r.result if r.status == "ok" else None for r in outcome.ranks]
    refused = [rank for rank, res in enumerate(results) if res and res.get("raised") in REFUSALS]
    if refused and len(refused) < world_size:
        other = next(rank for rank in range(world_size) if rank not in refused)
        res = results[other]
        if res is None:
            went = f"rank {other}'s process {_how_it_ended(outcome.ranks[other])}"
        elif res.get("raised"):
            went = (f"rank {other} did not refuse: it went on and raised {res['raised']}: {res['message']!r} "
                    "(left alone in the all-gather)")
        else:
            went = f"rank {other} did not refuse: it went on without an error"
        g.record("uneven-sequence-refused", False,
                 f"{said}: {'rank' if len(refused) == 1 else 'ranks'} {', '.join(map(str, refused))} raised "
                 f"{results[refused[0]]['raised']}, but {went}. The ranks must refuse together: compare every "
                 "rank's length with every other's (an all-reduce of [n, -n] with MAX gives the largest and the "
                 "smallest), not only the total", rank=other, world_size=world_size)
        return
    for rank, r in enumerate(outcome.ranks):
        if r.status != "ok":
            g.record("uneven-sequence-refused", False, f"{said}: rank {rank}'s process {_how_it_ended(r)}. Compare "
                     "the ranks' lengths before the all-gather and raise ValueError on every rank", rank=rank,
                     world_size=world_size)
            return
    problem = _refusal_problem(results, said)
    if problem is not None:
        rank, message = problem
        g.record("uneven-sequence-refused", False, message + ("" if "raised" in message else
                 ". Every rank must raise ValueError: compare the lengths (an all-reduce of [n, -n] with MAX)"),
                 rank=rank, world_size=world_size)
        return
    g.record("uneven-sequence-refused", True)


def _how_it_ended(r) -> str:
    err = r.error or {}
    if err:
        return f"raised {err.get('type')}: {str(err.get('message'))[:200]}"
    lines = [line for line in (r.output or "").splitlines() if line.strip()]
    last = f"; its last output: {lines[-1].strip()[:200]}" if lines else ""
    return f"ended without a result (exit code {r.exitcode}){last}"
