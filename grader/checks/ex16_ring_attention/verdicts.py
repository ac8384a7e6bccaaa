"""Exercise 16's verdicts: outputs, gradients, stability, messages, work, memory, groups, zigzag and uneven
lengths, each from the ranks' records (pure functions of them)."""

from __future__ import annotations

import torch

from grader.rank import probes
from grader.rank.drivers.ex16_ring_attention import (ATOL, BACKWARD_PER_BLOCK, BATCH, CHUNK, DTYPE, FORWARD_PER_BLOCK,
                                                    HEADS, HEAD_DIM, LARGE, MOST_HELD, REFUSALS, RTOL, SMALL_MESSAGE,
                                                    block_macs, groups_of, make_inputs, positions, uneven_lengths,
                                                    uneven_positions)
from grader.checks.ex16_ring_attention.reference import attention, reference
from grader.compare import tensor_difference
from grader.diagnose import last_words


# --- comparing ---------------------------------------------------------------------------------


def _chunk(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return tensor.index_select(2, torch.tensor(rows))


def _compare(got, want: torch.Tensor, whole, name: str):
    """``whole``: the tensor (or tensors) whose largest |value| sets the absolute tolerance."""
    wholes = whole if isinstance(whole, (list, tuple)) else [whole]
    scale = max([float(t.abs().max()) for t in wholes if t.numel()] or [1.0])
    return tensor_difference(got, want, rtol=RTOL, atol=ATOL * max(scale, 1e-30), name=name)


def _grad_scale(want: dict) -> list[torch.Tensor]:
    """The gradients of q, k and v, whose largest |value| is each gradient's scale: with one logit far above the
    rest in every row (a single chunk of the large-logits scenario) q's gradient is ~1e-7 at most, while each of
    its terms is of k's and v's size, so float64 rounding in a right answer leaves more than 1e-9 of q's own."""
    return [want[name] for name in ("q", "k", "v")]


def _close(got, want: torch.Tensor) -> bool:
    """Whether ``got`` equals ``want`` within the checks' own tolerance (never looser: an "it equals ..."
    diagnosis must not match what the check itself would have passed)."""
    return isinstance(got, torch.Tensor) and got.shape == want.shape and \
        torch.allclose(got.double(), want, rtol=RTOL, atol=ATOL * max(float(want.abs().max()), 1e-30))


FLOAT32_PRECISION = 1e-5  # relative to the output's largest value: float32 rounding after a softmax and a sum


def _float32_words(got, want: torch.Tensor) -> str:
    """What a wrong output that is right to float32's precision says: a step ran in float32."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return ""
    scale = max(float(want.abs().max()), 1e-30)
    off = float((got.double() - want).abs().max())
    if off > FLOAT32_PRECISION * scale:
        return ""
    return (f"; it is right to float32's precision only (off by {off:.2g}, {off / scale:.1g} of its largest value): "
            "a step ran in float32 where q, k and v are float64 (a buffer or constant made without dtype=q.dtype)")


def _failed_run(run: dict, name: str = "ring_attention") -> str | None:
    if run is None:
        return "this scenario was not run (an earlier one failed)"
    if run.get("error"):
        return f"{name} raised {run['error']}"
    return None


def explain_output(got, scenario: str, rank: int, world_size: int, rows: list[int]) -> str:
    """What a wrong output equals instead, when it equals something recognisable."""
    if not isinstance(got, torch.Tensor):
        return ""
    data = make_inputs(scenario, CHUNK * world_size)
    q, k, v = data["q"], data["k"], data["v"]
    causal = scenario == "causal"
    own = _chunk(q, rows), _chunk(k, rows), _chunk(v, rows)
    n = CHUNK * world_size
    right = _chunk(attention(q, k, v, causal), rows)
    candidates = [
        ("attention without the 1/sqrt(head_dim) scale", _chunk(attention(q, k, v, causal, scale=False), rows)),
        ("attention over this rank's own chunk alone: the other ranks' blocks never entered the result",
         attention(*own, causal)),
    ]
    if causal:
        upper = torch.ones(n, n, dtype=torch.bool).triu(1)
        own_block = torch.zeros(n, n, dtype=torch.bool)
        own_block[rows[0]:rows[-1] + 1, rows[0]:rows[-1] + 1] = True
        candidates += [
            ("non-causal attention: no mask was applied", _chunk(attention(q, k, v), rows)),
            (("causal attention with this rank's own block left unmasked: keys after the query inside the "
              "diagonal block were counted"), _chunk(attention(q, k, v, mask=upper & ~own_block), rows)),
        ]
    for words, value in candidates:
        if _close(got, value) and not _close(value, right):  # a candidate that is the right answer explains nothing
            return f"; it equals {words}"
    return _float32_words(got, right)


def check_outputs(g, observations: list[dict], expected: dict, world_size: int) -> None:
    for check_id, scenario, what in (("matches-attention", "plain", "non-causal"),
                                     ("causal-matches", "causal", "causal=True")):
        want = expected[scenario]["output"]
        for rank, obs in enumerate(observations):
            rows = positions(rank, world_size)
            got = obs[scenario]["output"]
            found = _compare(got, _chunk(want, rows), want, "output")
            if found is not None:
                g.record(check_id, False,
                         f"world size {world_size}, rank {rank} ({what}, positions {rows[0]}-{rows[-1]} of "
                         f"{CHUNK * world_size}): the output is not this rank's chunk of single-process attention: "
                         f"{found}{explain_output(got, scenario, rank, world_size, rows)}",
                         rank=rank, world_size=world_size)
                break
        else:
            g.record(check_id, True)


def explain_grads(run: dict, scenario: str, rank: int, world_size: int, rows: list[int]) -> str:
    """Whether k.grad and v.grad hold only this rank's own queries' share (the gradients never travelled)."""
    data = make_inputs(scenario, CHUNK * world_size)
    q, k, v = (data[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
    only_mine = torch.zeros_like(data["g"])
    only_mine[:, :, rows] = data["g"][:, :, rows]
    (attention(q, k, v, scenario == "causal") * only_mine).sum().backward()
    if _close(run["grads"]["k"], _chunk(k.grad, rows)) and _close(run["grads"]["v"], _chunk(v.grad, rows)):
        return ("; k.grad and v.grad hold only the share of this rank's own queries: the other ranks' shares of "
                "the gradients of this rank's block never came back to it")
    return ""


def _grads_problem(run: dict, want: dict, rows: list[int]) -> tuple[str, object] | None:
    if not run.get("backward_ran"):
        return "output", ("no backward could be run: the output is not a tensor of q's shape that requires grad "
                          f"(it is {_describe(run.get('output'))})")
    for name in ("q", "k", "v"):
        got = run["grads"][name]
        if got is None:
            return name, f"{name}.grad is None after backward: the output does not depend on {name} through autograd"
        found = _compare(got, _chunk(want[name], rows), _grad_scale(want), f"{name}.grad")
        if found is not None:
            return name, found
    return None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return str(value)


def check_gradients(g, observations: list[dict], expected: dict, world_size: int) -> None:
    for check_id, scenario, what in (("grads-match", "plain", "non-causal"),
                                     ("causal-grads-match", "causal", "causal=True")):
        for rank, obs in enumerate(observations):
            rows = positions(rank, world_size)
            run = obs[scenario]
            problem = _grads_problem(run, expected[scenario], rows)
            if problem is not None:
                name, found = problem
                why = explain_grads(run, scenario, rank, world_size, rows) if name in ("k", "v") else ""
                g.record(check_id, False,
                         f"world size {world_size}, rank {rank} ({what}): after backward of sum(output * G), "
                         f"{found}, against this rank's chunk of single-process attention's gradient{why}",
                         rank=rank, world_size=world_size)
                break
        else:
            g.record(check_id, True)


def check_stable(g, observations: list[dict], want: dict, world_size: int) -> None:
    """Large logits give the right output and gradients. What is wrong at ordinary logits too (the same rank's
    non-causal run) is not a matter of stability: left to matches-attention or grads-match."""
    ordinary = reference("plain", CHUNK * world_size, False)
    for rank, obs in enumerate(observations):
        run = obs.get("large")
        rows = positions(rank, world_size)
        failed = _failed_run(run)
        if failed is None:
            found = _compare(run["output"], _chunk(want["output"], rows), want["output"], "output")
            if found is not None:
                plain = obs.get("plain") or {}
                if _compare(plain.get("output"), _chunk(ordinary["output"], rows), ordinary["output"], "output"):
                    g.not_checked("stable-large-logits", "matches-attention", "the output is wrong at ordinary "
                                  "logits too", world_size=world_size)
                    return
                problem = f"the output: {found}"
            else:
                grads = _grads_problem(run, want, rows)
                if grads is None:
                    continue
                if _grads_problem(obs.get("plain") or {}, ordinary, rows) is not None:
                    g.not_checked("stable-large-logits", "grads-match", "the gradients are wrong at ordinary logits "
                                  "too: the backward is wrong whatever the logits", world_size=world_size)
                    return
                problem = (f"the output is right (the forward is stable) but the gradients are not: {grads[1]}. The "
                           "backward overflows where the forward did not: recompute the probabilities from the saved "
                           "log-sum-exp (or subtract each row's maximum there too)")
            bad = [name for name, t in [("output", run["output"]), *run["grads"].items()]
                   if isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all())]
            failed = problem + (f" ({', '.join(bad)} hold inf or NaN)" if bad else "")
        g.record("stable-large-logits", False,
                 f"world size {world_size}, rank {rank}: with the queries multiplied by {LARGE:g} (logits of about "
                 f"{LARGE:g}, exp of which overflows), {failed}", rank=rank, world_size=world_size)
        return
    g.record("stable-large-logits", True)


# --- messages -----------------------------------------------------------------------------------


def ring_peers(rank: int, members: list[int]) -> set[int]:
    """The global ranks of this rank's two neighbours in the ring of ``members`` (global ranks, in order)."""
    if len(members) < 2:
        return set()
    i = members.index(rank)
    return {members[(i + 1) % len(members)], members[(i - 1) % len(members)]}


def _stray_message(events: list[dict], rank: int, members: list[int]) -> str | None:
    """The first message to or from a rank that is not a ring neighbour, or collective of K/V-sized data."""
    peers = ring_peers(rank, members)
    for e in events:
        if e["op"] in probes.POINT_TO_POINT:
            if e["peer"] not in peers:
                to = "to" if e["op"] in ("send", "isend") else "from"
                near = ", ".join(map(str, sorted(peers))) or "none (a ring of one rank)"
                return (f"dist.{e['op']} of {e['bytes']} bytes {to} rank {e['peer']}, not a ring neighbour "
                        f"(rank {rank}'s are {near})")
        elif e["op"] in probes.COLLECTIVES and e["bytes"] > SMALL_MESSAGE:
            return (f"dist.{e['op']} of {e['bytes']} bytes: a collective talks to every rank, and this one "
                    f"carries more than the {SMALL_MESSAGE} bytes of a few numbers")
    return None


def check_neighbours(g, observations: list[dict], world_size: int) -> None:
    everyone = list(range(world_size))
    for scenario, what in (("plain", "non-causal"), ("causal", "causal=True")):
        for rank, obs in enumerate(observations):
            run = obs[scenario]
            for phase in ("forward", "backward"):
                stray = _stray_message(run[f"{phase}_events"], rank, everyone)
                if stray is not None:
                    g.record("ring-neighbours", False,
                             f"world size {world_size}, rank {rank}, {what} {phase}: {stray}",
                             rank=rank, world_size=world_size)
                    return
    g.record("ring-neighbours", True)


def big_messages(events: list[dict], ops: tuple[str, ...]) -> list[dict]:
    return [e for e in events if e["op"] in ops and e["bytes"] > SMALL_MESSAGE]


def check_hops(g, observations: list[dict], world_size: int) -> None:
    """Per forward, each rank sends and receives K and V blocks for W - 1 hops: 2 (W - 1) blocks' bytes
    (exactly without causal; at most with it, where a block nobody needs may stay home)."""
    block = BATCH * HEADS * CHUNK * HEAD_DIM * torch.finfo(DTYPE).bits // 8
    want = 2 * (world_size - 1) * block
    for scenario, exact in (("plain", True), ("causal", False)):
        for rank, obs in enumerate(observations):
            events = obs[scenario]["forward_events"]
            for ops, verb in ((("send", "isend"), "sent"), (("recv", "irecv"), "received")):
                moved = big_messages(events, ops)
                total = sum(e["bytes"] for e in moved)
                if total == want or (not exact and total < want):
                    continue
                what = "non-causal" if exact else "causal=True"
                g.record("ring-hops", False,
                         f"world size {world_size}, rank {rank}, {what} forward: it {verb} {total} bytes in "
                         f"{len(moved)} message(s) ({_blocks(total, block)}); K and V making {world_size - 1} "
                         f"hop(s) each are 2 x {world_size - 1} blocks of {BATCH}x{HEADS}x{CHUNK}x{HEAD_DIM} "
                         f"float64 = {want} bytes", rank=rank, world_size=world_size)
                return
    g.record("ring-hops", True)


def _blocks(total: int, block: int) -> str:
    count = total / block
    return f"{count:g} block(s)" if count == int(count) else f"{count:.2f} blocks"


# --- work and memory ---------------------------------------------------------------------------


def check_causal_work(g, observations: list[dict], world_size: int) -> None:
    unit = block_macs()
    for rank, obs in enumerate(observations):
        run = obs["causal"]
        for phase, per_block in (("forward", FORWARD_PER_BLOCK), ("backward", BACKWARD_PER_BLOCK)):
            if phase == "backward" and not run["backward_ran"]:
                continue
            done = run[f"{phase}_macs"] / unit
            allowed = per_block * (rank + 1)
            if done > allowed + 1e-9:
                future = world_size - rank - 1
                g.record("causal-skips-future", False,
                         f"world size {world_size}, rank {rank}, causal=True {phase}: its matrix products came to "
                         f"{done:g} block products (one block product: {CHUNK} queries against {CHUNK} keys, "
                         f"head_dim {HEAD_DIM}, {BATCH} x {HEADS} batch and heads, {unit} multiply-adds); rank "
                         f"{rank} needs the blocks of ranks 0 to {rank} only, {rank + 1} block(s) at {per_block} "
                         f"products each at most: {allowed:g}. The {future} block(s) of later ranks are wholly in "
                         "its future", rank=rank, world_size=world_size)
                return
    g.record("causal-skips-future", True)


def check_held(g, observations: list[dict], world_size: int) -> None:
    for scenario, what in (("plain", "non-causal"), ("causal", "causal=True")):
        for rank, obs in enumerate(observations):
            held = obs[scenario].get("held") or {}
            most = held.get("most", [])
            if len(most) > MOST_HELD:
                g.record("two-blocks-held", False,
                         f"world size {world_size}, rank {rank}, {what}: {held['where']}, the K/V blocks of "
                         f"{len(most)} other ranks were in its memory at once (ranks "
                         f"{', '.join(map(str, most))}, found byte for byte in its variables, its autograd graph "
                         f"and what autograd saved for backward); at most {MOST_HELD} may be",
                         rank=rank, world_size=world_size)
                return
    g.record("two-blocks-held", True)


# --- groups, zigzag, uneven ---------------------------------------------------------------------


def check_group(g, observations: list[dict], expected: dict, world_size: int) -> None:
    for rank, obs in enumerate(observations):
        run = obs.get("group")
        if run is None:
            zigzag_failed = (obs.get("zigzag") or {}).get("error")
            g.not_checked("uses-group", "zigzag-matches" if zigzag_failed else "stable-large-logits",
                          "not run: the scenario before it failed", world_size=world_size)
            return
        members = run["members"]
        said = (f"world size {world_size}, rank {rank} in group={members} (ring_attention(q, k, v, group=...), "
                f"each of {groups_of(world_size)} running a ring of its own)")
        if run.get("error"):
            g.record("uses-group", False, f"{said}: it raised {run['error']}", rank=rank, world_size=world_size)
            return
        want = expected[len(members)]
        rows = positions(members.index(rank), len(members))
        found = _compare(run["output"], _chunk(want["output"], rows), want["output"], "output")
        problem = None if found is None else f"the output: {found}"
        if problem is None:
            grads = _grads_problem(run, want, rows)
            problem = None if grads is None else f"the gradients: {grads[1]}"
        if problem is None:
            stray = _stray_message(run["forward_events"] + run["backward_events"], rank, members)
            problem = None if stray is None else stray + " in the group's ring"
        if problem is not None:
            g.record("uses-group", False, f"{said}: {problem}. The sequence is the group's: rank {rank} is rank "
                     f"{members.index(rank)} of {len(members)} there", rank=rank, world_size=world_size)
            return
    g.record("uses-group", True)


def check_zigzag(g, observations: list[dict], want: dict, world_size: int) -> str:
    """Records both zigzag checks; returns "absent" when there is no zigzag to grade, else "graded"."""
    runs = [obs.get("zigzag") for obs in observations]
    if any(run is None for run in runs):
        for check_id in ("zigzag-matches", "zigzag-balanced"):
            g.not_checked(check_id, "stable-large-logits", "not run: the scenario before it failed",
                          world_size=world_size)
        return "graded"
    if all(run is not None and (run.get("absent") or run.get("not_implemented")) for run in runs):
        return "absent"
    for rank, run in enumerate(runs):
        failed = _failed_run(run, "zigzag_ring_attention") or ("it raised NotImplementedError on this rank only"
                                      if run.get("not_implemented") or run.get("absent") else None)
        rows = positions(rank, world_size, zigzag=True)
        if failed is None:
            found = _compare(run["output"], _chunk(want["output"], rows), want["output"], "output")
            failed = None if found is None else f"the output: {found}"
        if failed is None:
            grads = _grads_problem(run, want, rows)
            failed = None if grads is None else f"the gradients: {grads[1]}"
        if failed is not None:
            half = CHUNK // 2
            g.record("zigzag-matches", False,
                     f"world size {world_size}, rank {rank} holding positions {rows[:half]} and {rows[half:]} "
                     f"(chunks {rank} and {2 * world_size - 1 - rank} of {2 * world_size}): {failed}, against "
                     "causal single-process attention", rank=rank, world_size=world_size)
            g.not_checked("zigzag-balanced", "zigzag-matches", "the zigzag results are wrong",
                          world_size=world_size)
            return "graded"
    g.record("zigzag-matches", True)
    unit = block_macs()
    for rank, run in enumerate(runs):
        for phase, per_block in (("forward", FORWARD_PER_BLOCK), ("backward", BACKWARD_PER_BLOCK)):
            done = run[f"{phase}_macs"] / unit
            allowed = per_block * (world_size + 1) / 2
            if done > allowed + 1e-9:
                g.record("zigzag-balanced", False,
                         f"world size {world_size}, rank {rank}, zigzag {phase}: its matrix products came to "
                         f"{done:g} block products ({CHUNK} queries against {CHUNK} keys each); a balanced zigzag "
                         f"multiplies its own block and half a block of each of the {world_size - 1} other ranks, "
                         f"at {per_block} products per block at most: {allowed:g}", rank=rank, world_size=world_size)
                return "graded"
    g.record("zigzag-balanced", True)
    return "graded"


def uneven_words(world_size: int, pattern: str) -> str:
    """The lengths of an uneven pattern, and why a check that only adds them up misses it."""
    lengths = uneven_lengths(world_size, pattern)
    if pattern == "sum-hides":
        return (f"world size {world_size}, chunks of lengths {lengths} (their sum is {sum(lengths)} = {CHUNK} x "
                f"{world_size}: a rank holding {CHUNK} cannot tell from the sum that the lengths differ)")
    return f"world size {world_size}, chunks of lengths {lengths} (a sequence of {sum(lengths)} cut by tensor_split)"


def _ended(rank: int, r) -> str:
    err = r.error or {}
    if err:
        return f"rank {rank}'s process raised {err.get('type')}: {str(err.get('message'))[:200]}"
    return f"rank {rank}'s process ended without a result (exit code {r.exitcode}){_last_line(r.output)}"


def check_uneven(g, outcome, world_size: int, pattern: str = "one-longer") -> None:
    """Chunks of different lengths: every rank refuses (ValueError or assert), or every rank's result is right."""
    lengths = uneven_lengths(world_size, pattern)
    said = uneven_words(world_size, pattern)
    results = [r.result if r.status == "ok" else None for r in outcome.ranks]
    refused = [rank for rank, res in enumerate(results) if res and res["raised"] in REFUSALS]
    if refused and len(refused) < world_size:
        other = next(rank for rank in range(world_size) if rank not in refused)
        res, r = results[other], outcome.ranks[other]
        if res is None:
            went = _ended(other, r)
        elif res["raised"]:
            went = (f"rank {other} did not refuse: it went on and raised {res['raised']}: {res['message']!r} "
                    "(left alone in the ring)")
        else:
            went = f"rank {other} did not refuse: it returned an output"
        g.record("uneven-refused", False, f"{said}: {_ranks(refused)} raised {results[refused[0]]['raised']}, but "
                 f"{went}. The ranks must refuse together: compare every rank's length with every other's (the "
                 "largest and the smallest), not only a neighbour's or the total", rank=other, world_size=world_size)
        return
    for rank, r in enumerate(outcome.ranks):
        if r.status != "ok":
            g.record("uneven-refused", False, f"{said}: {_ended(rank, r)}. Refuse such chunks with a "
                     "ValueError on every rank, before the ring starts", rank=rank, world_size=world_size)
            return
    raised = [(rank, res) for rank, res in enumerate(results) if res["raised"]]
    if raised:
        accident = next(((rank, res) for rank, res in raised if res["raised"] not in REFUSALS), None)
        if accident is not None:
            rank, res = accident
            g.record("uneven-refused", False, f"{said}: rank {rank} raised {res['raised']}: {res['message']!r}, "
                     "an accident of the lengths rather than a refusal; raise ValueError saying the lengths, on "
                     "every rank, before the ring starts", rank=rank, world_size=world_size)
            return
        g.record("uneven-refused", True)
        return
    # Every rank returned: then every result must be right.
    want = reference("uneven", sum(lengths), False)
    for rank, res in enumerate(results):
        rows = uneven_positions(world_size, pattern)[rank]
        found = _compare(res["output"], _chunk(want["output"], rows), want["output"], "output")
        if found is None and res.get("grads") is not None:
            for name in ("q", "k", "v"):
                found = _compare(res["grads"][name], _chunk(want[name], rows), _grad_scale(want), f"{name}.grad")
                if found is not None:
                    break
        elif found is None:
            found = f"backward failed: {res.get('backward_error')}"
        if found is not None:
            g.record("uneven-refused", False, f"{said}: no rank refused, and rank {rank}'s result is wrong: {found}. "
                     "Raise ValueError on every rank when the lengths differ", rank=rank, world_size=world_size)
            return
    g.record("uneven-refused", True)


def _ranks(numbers: list[int]) -> str:
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(map(str, numbers))


def _last_line(output: str) -> str:
    said = last_words(output)  # gloo's own line when it aborted the process
    return f"; its last output: {said[:200]}" if said else ""
