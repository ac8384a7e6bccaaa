"""Exercise 18: SequenceParallelBlock (Megatron-style sequence parallelism around a tensor-parallel MLP).

Rank side (:mod:`grader.checks.ex18_rank`): every rank builds the same dense LayerNorm, fc1 and fc2
(float64, seeded), wraps them in the learner's block, measures the bytes the block holds, feeds its
chunk of x and runs backward of sum(output * G). It records the output, x's gradient, every
parameter's value and .grad, every collective of forward and of backward (torch.distributed's calls,
and the functional collectives autograd runs from C++, which a dispatch mode sees), and what autograd saved
during forward (saved_tensors_hooks: each storage once, with its bytes and values). Then, in the same
run: (in the largest world) two groups, the even and the odd ranks, each with a block and a sequence
of its own; a hidden size the world size does not divide; an input whose last dimension is wrong. One
more run per pattern gives the ranks chunks of different lengths (rank 0 one longer; lengths whose sum is
W times the mean, which a check of the total misses). Grader side: the dense block runs in this
process on the same modules and input; each rank's tensors are compared with its chunk or block of the
dense ones. The parameters are found by their values (the names are the learner's); the tensors autograd
saved are sorted into the parallel region's (fc1's gathered input, the hidden blocks) and the rest by the
shapes they were saved in, never by their values, so that a wrong GELU or eps fails the output alone. A
second forward and backward of the same block, its gradients cleared between, must give what the first
gave (hooks registered in forward pile up there). The verdicts that need no dense block (the collectives,
the refusals) are in ex18_verdicts.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from grader.checks.ex18_rank import (ATOL, BATCH, D_MODEL, NORM_EPS, RTOL, UNEVEN_PATTERNS, SavedTensors, build,
                                     chunk_elements, chunk_rows, groups_of, hidden_block, sizes)
from grader.checks.ex18_rank import rank_main, uneven_main
from grader.checks.ex18_verdicts import (_describe, _no_backward, _where, activation_collectives,  # noqa: F401
                                         check_collectives, check_hidden, check_shape, check_uneven, uneven_words)
from grader.checks.interface import Grader
from grader.compare import tensor_difference

REPLICATED = ("norm.weight", "norm.bias", "fc2.bias")
SPLIT = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # the dimension of each split parameter
HELD_SLACK = 256  # bytes of small tensors a block may keep besides its parameters (a flag, an index)
AGREE_RTOL = 1e-12  # replicated gradients after an all-reduce are the same numbers on every rank


# --- in the grader ------------------------------------------------------------------------------


def dense(data: dict, blocks: tuple[slice, ...] = ()) -> dict:
    """The dense block on the whole sequence: output, x's gradient, every parameter's value and gradient,
    and its intermediates. ``blocks``: keep only those hidden features (a rank's own term of the sum)."""
    norm, fc1, fc2 = data["norm"], data["fc1"], data["fc2"]
    params = {"norm.weight": norm.weight, "norm.bias": norm.bias, "fc1.weight": fc1.weight, "fc1.bias": fc1.bias,
              "fc2.weight": fc2.weight, "fc2.bias": fc2.bias}
    for p in params.values():
        p.grad = None
    x = data["x"].clone().requires_grad_(True)
    saved = SavedTensors(list(params.values()))
    with saved.hooks():
        normed = norm(x)
        w1, b1, w2 = fc1.weight, fc1.bias, fc2.weight
        if blocks:
            w1, b1, w2 = w1[blocks[0]], b1[blocks[0]], w2[:, blocks[0]]
        hidden = F.linear(normed, w1, b1)
        activated = F.gelu(hidden)
        out = x + F.linear(activated, w2, fc2.bias)
    (out * data["g"]).sum().backward()
    return {"output": out.detach(), "x_grad": x.grad.detach(), "saved": saved.record(), "x": data["x"],
            "values": {name: p.detach().clone() for name, p in params.items()},
            "grads": {name: p.grad.detach().clone() for name, p in params.items()},
            "normed": normed.detach(), "hidden": hidden.detach(), "activated": activated.detach()}


@functools.cache
def reference(scenario: str, world_size: int, salt: int = 0, block: tuple[int, int] | None = None,
              eps: float | None = None) -> dict:
    """The dense block of a scenario split over ``world_size`` ranks (its sizes: ``sizes``), computed once;
    ``block``: only those hidden features; ``eps``: the norm's eps replaced by this one."""
    seq, hidden = sizes(world_size)
    data = build(scenario, seq, hidden, salt=salt)
    if eps is not None:
        data["norm"].eps = eps
    return dense(data, (slice(*block),) if block else ())


def expected_main(world_size: int) -> dict:
    return reference("main", world_size)


def _own_term(rank: int, world_size: int) -> dict:
    block = hidden_block(rank, world_size, sizes(world_size)[1])
    return reference("main", world_size, block=(block.start, block.stop))


def _seq(want: dict) -> int:
    return want["x"].shape[0]


def _hidden(want: dict) -> int:
    return want["values"]["fc1.weight"].shape[0]


def share_of(want: dict, name: str, rank: int, world_size: int, key: str = "values") -> torch.Tensor:
    """Rank ``rank``'s share of a dense parameter (its value or gradient): its block, or the whole."""
    tensor = want[key][name]
    if name in REPLICATED:
        return tensor
    hidden = _hidden(want)
    return tensor.narrow(SPLIT[name], hidden_block(rank, world_size, hidden).start, hidden // world_size)


def grade(g: Grader) -> None:
    largest = max(g.world_sizes)
    runs = [g.Run(rank_main, world_size, {"groups": world_size == largest}) for world_size in g.world_sizes]
    if largest >= 2:  # chunks of different lengths, each pattern in a run of its own: gloo may abort a rank there
        runs += [g.Run(uneven_main, largest, {"pattern": pattern}, expect_ok=False) for pattern in UNEVEN_PATTERNS]
    outcomes = g.run_at_once(runs)  # light runs: a re-grade waits for the slowest, not for their sum
    lines = []
    for world_size in g.world_sizes:
        observations = next(outcomes).results()
        want = expected_main(world_size)
        main_ok = all([check_output(g, observations, want, world_size),
                       check_input_grad(g, observations, want, world_size),
                       check_slices(g, observations, want, world_size),
                       check_replicated(g, observations, want, world_size)])
        check_second_step(g, observations, world_size)
        check_collectives(g, observations, world_size)
        check_saved(g, observations, want, world_size)
        check_held(g, observations, want, world_size)
        check_hidden(g, observations, world_size)
        check_shape(g, observations, world_size)
        if world_size == largest:
            check_group(g, observations, world_size, main_ok)
        lines.append(describe(observations, want, world_size))
    if largest >= 2:
        for pattern in UNEVEN_PATTERNS:
            check_uneven(g, next(outcomes), largest, pattern)
    else:
        g.skip("uneven-sequence-refused", "one rank: every sequence is divisible by 1")
    g.section("the block, as measured", "\n".join(lines))


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
         _own_term(rank, world_size)["output"][rows]),
    ]
    for words, value in candidates:
        if _close(got, value) and not _close(value, want):  # a candidate that is the right answer explains nothing
            return f"; it equals {words}"
    return ""


def check_output(g, observations: list[dict], want: dict, world_size: int) -> bool:
    for rank, obs in enumerate(observations):
        got = obs["main"]["output"]
        found = _compare(got, want["output"][chunk_rows(rank, world_size, _seq(want))], "output")
        if found is not None:
            return g.record("output-matches", False,
                            f"{_where(rank, world_size)}: the output is not this rank's chunk of the dense block's "
                            f"x + fc2(gelu(fc1(norm(x)))): {found}{explain_output(got, rank, world_size)}",
                            rank=rank, world_size=world_size)
    return g.record("output-matches", True)


def check_input_grad(g, observations: list[dict], want: dict, world_size: int) -> bool:
    for rank, obs in enumerate(observations):
        run = obs["main"]
        rows = chunk_rows(rank, world_size, _seq(want))
        if not run["backward_ran"]:
            problem = _no_backward(run)
        elif run["input_grad"] is None:
            problem = "x.grad is None after backward: the output does not depend on x through autograd"
        else:
            found = _compare(run["input_grad"], want["x_grad"][rows], "x.grad")
            problem = None if found is None else f"{found}, against this rank's chunk of the dense x.grad"
            if found is not None:
                own = _own_term(rank, world_size)["x_grad"][rows]
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
    hidden = _hidden(want)
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


# --- memory -------------------------------------------------------------------------------------


def _sorted_values(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().reshape(-1).sort().values


def classify_saved(saved: list[dict], hidden_width: int, whole: int, parameters: list[torch.Tensor]) -> list[dict]:
    """Each saved storage with "kind" and "elements" (its bytes / 8), told apart by the shapes autograd saved it
    in, never by its values (a wrong GELU or eps changes the values, not where a tensor lies):

    * "inside": a view's last dimension is ``hidden_width``: this rank's hidden block (fc1's output, GELU's, fc2's
      input), which lies in the parallel region whatever its values;
    * "gathered": fc1's input, the whole sequence at the model's width (``whole`` elements): the last such storage
      saved, as fc1 runs after the norm;
    * "parameter": a copy of one of ``parameters``' values (exactly: they are the grader's, copied);
    * "outside": the rest: the norm's input and statistics, the residual's.
    """
    param_sorted = [_sorted_values(t) for t in parameters]
    out = []
    for entry in saved:
        kind = "outside"
        if any(v["shape"] and v["shape"][-1] == hidden_width for v in entry["views"]):
            kind = "inside"
        else:
            for view in entry["views"]:
                values = view["values"]
                if isinstance(values, torch.Tensor) and any(
                        _sorted_values(values).shape == ref.shape and torch.equal(_sorted_values(values), ref)
                        for ref in param_sorted):
                    kind = "parameter"
        out.append({**entry, "kind": kind, "elements": entry["bytes"] // 8})
    gathered = [e for e in out if e["kind"] == "outside" and e["elements"] == whole]
    if gathered:
        gathered[-1]["kind"] = "gathered"
    return out


def inside_tensors(want: dict, rank: int, world_size: int) -> list[torch.Tensor]:
    """What a rank saves inside the parallel region: fc1's whole input, its hidden block before and after GELU."""
    block = hidden_block(rank, world_size, _hidden(want))
    return [want["normed"], want["hidden"][..., block], want["activated"][..., block]]


def _whole(want: dict) -> int:
    """Elements of one activation of the whole sequence at the model's width: seq x batch x d."""
    return _seq(want) * BATCH * D_MODEL


def outside_bytes_dense(want: dict) -> int:
    entries = classify_saved(want["saved"], _hidden(want), _whole(want), list(want["values"].values()))
    return sum(e["bytes"] for e in entries if e["kind"] == "outside")


def rank_saved(obs: dict, want: dict, rank: int, world_size: int) -> list[dict]:
    """What rank ``rank`` saved in the main scenario's forward, classified (classify_saved)."""
    params = [share_of(want, name, rank, world_size) for name in (*REPLICATED, *SPLIT)]
    return classify_saved(obs["main"]["saved"] or [], _hidden(want) // world_size, _whole(want), params)


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
                     f"one chunk of the activation ({_seq(want) // world_size}x{BATCH}x{D_MODEL} = {limit}): in all "
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
        rows = chunk_rows(members.index(rank), len(members), _seq(want))
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


# --- the report's section -----------------------------------------------------------------------


def describe(observations: list[dict], want: dict, world_size: int) -> str:
    """One line per world size: rank 0's collectives, its saves outside the region, its bytes held."""
    run = observations[0]["main"]
    parts = []
    for phase in ("forward", "backward"):
        kinds = activation_collectives(run[f"{phase}_events"], world_size)
        parts.append(f"{phase}: {len(kinds['gather'])} all-gather, {len(kinds['scatter'])} reduce-scatter, "
                     f"{len(kinds['other'])} other")
    entries = rank_saved(observations[0], want, 0, world_size)
    outside = sum(e["bytes"] for e in entries if e["kind"] == "outside")
    return (f"world size {world_size}, rank 0: {'; '.join(parts)}; saved outside the parallel region {outside} bytes "
            f"(the dense block: {outside_bytes_dense(want)}); its block holds {observations[0]['held_bytes']} bytes")
