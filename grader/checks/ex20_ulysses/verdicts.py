"""Exercise 20's verdicts: pure functions of what the ranks recorded (tests/test_ex20_ulysses.py feeds them
hand-made records). Every value a rank sent is read as untrusted: a tensor is compared only after its type
and shape are checked (grader.compare does), an event only after its fields are."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex20_ulysses import (ATOL, CHUNK, RTOL, SMALL_MESSAGE, groups_of, heads_share, make_inputs,
                                              positions, replication, shapes)
from grader.checks.ex20_ulysses.reference import attention, bytes_to_send, expected
from grader.compare import tensor_difference
from grader.diagnose import last_words

CHECKED = ("plain", "causal", "gqa", "few-kv")  # the scenarios whose messages are judged
TENSORS = ("q", "k", "v")
FLOAT32_PRECISION = 1e-5  # relative to the largest expected value: float32 rounding after a softmax and a sum


# --- reading what a rank sent -------------------------------------------------------------------


def _run(obs, scenario: str) -> dict | None:
    run = obs.get(scenario) if isinstance(obs, dict) else None
    return run if isinstance(run, dict) else None


def _number(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def clean_events(events) -> list[dict] | None:
    """The collectives a rank recorded, each field checked; None when the record is not what the driver writes."""
    if not isinstance(events, list):
        return None
    out = []
    for e in events:
        if not isinstance(e, dict) or not isinstance(e.get("op"), str) or _number(e.get("bytes")) is None:
            return None
        group = e.get("group")
        if group is not None and not (isinstance(group, list) and all(_number(r) is not None for r in group)):
            return None
        kept, sent = e.get("kept"), e.get("sent")
        if (kept is None) != (sent is None) or (kept is not None and (_number(kept) is None or _number(sent) is None)):
            return None
        out.append({"op": e["op"], "bytes": e["bytes"], "group": group, "kept": kept, "sent": sent})
    return out


def is_all_to_all(event: dict) -> bool:
    return event["kept"] is not None


def _op(event: dict) -> str:
    """A dispatched op's name as a learner knows it: c10d.alltoall_base_.default -> alltoall_base_."""
    parts = event["op"].split(".")
    return parts[1] if len(parts) > 1 else event["op"]


def _chunk(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return tensor[:, :, positions(rank, world_size)]


def _compare(got, want: torch.Tensor, whole: torch.Tensor, name: str):
    scale = float(whole.abs().max()) if whole.numel() else 1.0
    return tensor_difference(got, want, rtol=RTOL, atol=ATOL * max(scale, 1e-30), name=name)


def _close(got, want: torch.Tensor) -> bool:
    """Whether ``got`` equals ``want`` within the checks' own tolerance (never looser)."""
    return isinstance(got, torch.Tensor) and got.shape == want.shape and \
        torch.allclose(got.double(), want, rtol=RTOL, atol=ATOL * max(float(want.abs().max()), 1e-30))


def _said(scenario: str, world_size: int, rank: int) -> str:
    heads, kv_heads, causal = shapes(scenario, world_size)
    mask = ", causal=True" if causal else ""
    return (f"world size {world_size}, rank {rank} ({heads} heads, {kv_heads} key/value heads{mask}, positions "
            f"{rank * CHUNK}-{(rank + 1) * CHUNK - 1} of {CHUNK * world_size})")


# --- outputs and gradients ----------------------------------------------------------------------


def explain_output(got, scenario: str, rank: int, world_size: int, plain_right: bool) -> str:
    """What a wrong output is instead, when it is something recognisable."""
    if not isinstance(got, torch.Tensor) or got.dim() != 4:
        return ""
    data = make_inputs(scenario, world_size)
    heads, kv_heads, causal = shapes(scenario, world_size)
    want = _chunk(expected(scenario, world_size)["output"], rank, world_size)
    if got.shape != want.shape:
        return ""
    own = [_chunk(data[name], rank, world_size) for name in TENSORS]
    alone = attention(*own, causal)
    if _close(got, alone) and not _close(want, alone):
        if causal and plain_right:
            return (f"; the non-causal output is right, so every key arrived, but this is causal attention within the "
                    f"rank's own chunk of {CHUNK} positions: a causal mask cut per chunk, the earlier chunks' keys masked "
                    f"out. The query at position i attends to every key j <= i of the whole sequence: one triangular "
                    f"mask over all {CHUNK * world_size} positions (is_causal=True on the sequence the exchange made)")
        return "; it equals attention over this rank's own chunk alone: the other ranks' positions never arrived"
    if causal and _close(got, _chunk(attention(data["q"], data["k"], data["v"]), rank, world_size)):
        return "; it equals attention without the causal mask"
    local = _local_attention(got, data, causal, rank, world_size)
    if local:
        return local
    if causal and plain_right:
        return ("; the non-causal output is right, so every key arrived: the whole sequence was not in position "
                "order when the mask was applied (line the received chunks up by the rank they came from)")
    found = _heads_moved(got, want)
    if found:
        return found
    scale = max(float(want.abs().max()), 1e-30)
    off = float((got.double() - want).abs().max())
    if off <= FLOAT32_PRECISION * scale:
        return (f"; it is right to float32's precision only (off by {off:.2g}): a step ran in float32 where q, k "
                "and v are float64")
    return ""


LOCAL_MISTAKES = (  # attention computed between the exchanges, wrong in itself: (arguments, what it did)
    ({"scale": "1/d"}, "q k^T divided by head_dim, not by sqrt(head_dim): the scores were scaled twice "
                       "(F.scaled_dot_product_attention divides by sqrt(head_dim) itself)"),
    ({"scale": 1.0}, "q k^T not divided by sqrt(head_dim)"),
    ({"over": -2}, "the softmax taken over the queries (dim -2): each query's weights sum to 1 over the keys, the "
                   "last dimension"),
)


def _local_attention(got: torch.Tensor, data: dict, causal: bool, rank: int, world_size: int) -> str:
    """When ``got`` is this rank's chunk of a recognisable wrong attention over the whole sequence: the exchanges
    were right, the attention between them was not."""
    head_dim = data["q"].shape[-1]
    for arguments, what in LOCAL_MISTAKES:
        scale = 1 / head_dim if arguments.get("scale") == "1/d" else arguments.get("scale")
        wrong = attention(data["q"], data["k"], data["v"], causal, scale=scale, over=arguments.get("over", -1))
        if _close(got, _chunk(wrong, rank, world_size)):
            return (f"; it is attention over the whole sequence with {what}. The all-to-alls put every head and "
                    "position in its place: the attention between them is what differs")
    return ""


def _heads_moved(got: torch.Tensor, want: torch.Tensor) -> str:
    """When every head of the output is another head's right output: which went where."""
    places = []
    for head in range(got.shape[1]):
        match = next((h for h in range(want.shape[1]) if _close(got[:, head], want[:, h])), None)
        if match is None:
            return ""
        places.append(match)
    if places == list(range(got.shape[1])):
        return ""
    return (f"; each head holds another head's right output (heads 0-{len(places) - 1} hold heads {places}): the "
            "all-to-all back put the heads in another order than the one there took them in")


def _grads_problem(run: dict, scenario: str, rank: int, world_size: int) -> tuple[str, str] | None:
    """(tensor, what is wrong) for the first wrong gradient, or None."""
    if not run.get("backward_ran"):
        return "output", ("no backward could be run: the output is not a tensor of q's shape that requires grad "
                          f"(it is {_describe(run.get('output'))}): the all-to-alls need a backward of their own")
    want = expected(scenario, world_size)
    grads = run.get("grads") if isinstance(run.get("grads"), dict) else {}
    for name in TENSORS:
        got = grads.get(name)
        if got is None:
            return name, f"{name}.grad is None after backward: the output does not reach {name} through autograd"
        found = _compare(got, _chunk(want[name], rank, world_size), want[name], f"{name}.grad")
        if found is not None:
            return name, str(found)
    return None


def _describe(value) -> str:
    return f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else str(value)


def _not_run(g, check_id: str, world_size: int) -> None:
    g.not_checked(check_id, "matches-attention", "the scenario was not run", world_size=world_size)


def check_outputs(g, observations: list, world_size: int) -> None:
    for check_id, scenario in (("matches-attention", "plain"), ("causal-matches", "causal")):
        want = expected(scenario, world_size)["output"]
        for rank, obs in enumerate(observations):
            run = _run(obs, scenario)
            if run is None:
                _not_run(g, check_id, world_size)
                break
            found = _compare(run.get("output"), _chunk(want, rank, world_size), want, "output")
            if found is not None:
                plain = _run(obs, "plain") or {}
                plain_right = _close(plain.get("output"), _chunk(expected("plain", world_size)["output"], rank,
                                                                 world_size))
                g.record(check_id, False, f"{_said(scenario, world_size, rank)}: the output is not this rank's chunk "
                         f"of single-process attention: {found}"
                         f"{explain_output(run.get('output'), scenario, rank, world_size, plain_right)}",
                         rank=rank, world_size=world_size)
                break
        else:
            g.record(check_id, True)


def check_gradients(g, observations: list, world_size: int) -> None:
    for check_id, scenario in (("grads-match", "plain"), ("causal-grads-match", "causal")):
        for rank, obs in enumerate(observations):
            run = _run(obs, scenario)
            if run is None:
                _not_run(g, check_id, world_size)
                break
            problem = _grads_problem(run, scenario, rank, world_size)
            if problem is not None:
                name, found = problem
                said = found if name == "output" else (f"after backward of sum(output * G), {found}, against this "
                                                       "rank's chunk of single-process attention's gradient")
                g.record(check_id, False, f"{_said(scenario, world_size, rank)}: {said}", rank=rank,
                         world_size=world_size)
                break
        else:
            g.record(check_id, True)


def pairing(got, scenario: str, rank: int, world_size: int) -> list[int] | None:
    """The key/value head each query head of ``got`` attended with, when every head matches one."""
    if not isinstance(got, torch.Tensor) or got.dim() != 4:
        return None
    data = make_inputs(scenario, world_size)
    heads, kv_heads, _ = shapes(scenario, world_size)
    if tuple(got.shape) != (data["q"].shape[0], heads, CHUNK, data["q"].shape[-1]):
        return None
    found = []
    for head in range(heads):
        q = data["q"][:, head:head + 1]
        match = next((j for j in range(kv_heads) if _close(
            got[:, head:head + 1], _chunk(attention(q, data["k"][:, j:j + 1], data["v"][:, j:j + 1]), rank,
                                          world_size))), None)
        if match is None:
            return None
        found.append(match)
    return found


def check_gqa(g, observations: list, world_size: int) -> None:
    """Grouped-query attention, key/value heads divisible by W and fewer than W: output and gradients."""
    for scenario in ("gqa", "few-kv"):
        heads, kv_heads, _ = shapes(scenario, world_size)
        want = expected(scenario, world_size)
        for rank, obs in enumerate(observations):
            run = _run(obs, scenario)
            said = _said(scenario, world_size, rank)
            if run is None:
                g.not_checked("gqa-matches", "matches-attention", "not run: the scenario before it failed",
                              world_size=world_size)
                return
            if run.get("error"):
                g.record("gqa-matches", False, f"{said}: ulysses_attention raised {run['error']}",
                         rank=rank, world_size=world_size)
                return
            found = _compare(run.get("output"), _chunk(want["output"], rank, world_size), want["output"], "output")
            problem = None if found is None else f"the output: {found}"
            if problem is not None:
                paired = pairing(run.get("output"), scenario, rank, world_size)
                right = [h // (heads // kv_heads) for h in range(heads)]
                if paired is not None and paired != right:
                    problem += (f"; its query heads 0-{heads - 1} attended with key/value heads {paired}, where query "
                                f"head h goes with key/value head h // {heads // kv_heads}: {right}")
                else:
                    problem += _local_attention(run.get("output"), make_inputs(scenario, world_size), False, rank,
                                                world_size)
            else:
                grads = _grads_problem(run, scenario, rank, world_size)
                problem = None if grads is None else f"the gradients: {grads[1]}"
            if problem is not None:
                g.record("gqa-matches", False, f"{said}: {problem}", rank=rank, world_size=world_size)
                return
    g.record("gqa-matches", True)


# --- messages -----------------------------------------------------------------------------------


def _data(events: list[dict]) -> list[dict]:
    return [e for e in events if e["bytes"] > SMALL_MESSAGE]


def check_messages(g, observations: list, world_size: int) -> None:
    """only-all-to-alls (what carried data, how many all-to-alls each way) and bytes-off-rank (each keeps
    its own part; the totals each way). Bytes are judged where all-to-alls alone carried the data."""
    stray, bytes_decided, bytes_ok = None, False, True
    for scenario in CHECKED:
        for rank, obs in enumerate(observations):
            run = _run(obs, scenario)
            if run is None or run.get("error"):
                continue  # judged by the scenario's own check
            for phase in ("forward", "backward"):
                if phase == "backward" and not run.get("backward_ran"):
                    continue
                events = clean_events(run.get(f"{phase}_events"))
                where = f"{_said(scenario, world_size, rank)}, {phase}"
                if events is None:
                    g.record("only-all-to-alls", False, f"{where}: the record of its collectives is not a list of "
                             "events as the grader's driver writes them", rank=rank, world_size=world_size)
                    g.not_checked("bytes-off-rank", "only-all-to-alls", "no record of the messages",
                                  world_size=world_size)
                    return
                kind, problem = _stray(events, phase)
                if problem is not None and stray is None:
                    stray = (where, problem, rank)
                if kind == "foreign" or not bytes_ok:
                    continue
                bytes_decided = True
                bytes_ok = _bytes_right(g, events, scenario, phase, world_size, rank, where)
    if stray is not None:
        where, problem, rank = stray
        g.record("only-all-to-alls", False, f"{where}: {problem}", rank=rank, world_size=world_size)
    else:
        g.record("only-all-to-alls", True)
    if bytes_ok and bytes_decided:
        g.record("bytes-off-rank", True)
    elif not bytes_decided:
        g.not_checked("bytes-off-rank", "only-all-to-alls", "data went by other collectives than all-to-alls",
                      world_size=world_size)


def _stray(events: list[dict], phase: str) -> tuple[str, str | None]:
    """("foreign", why) when another collective carried data; ("count", why) when the all-to-alls were too
    few or too many; ("", None) when the messages are the method's."""
    data = _data(events)
    other = next((e for e in data if not is_all_to_all(e)), None)
    if other is not None:
        return "foreign", (f"{_op(other)} of {other['bytes']} bytes: only all-to-alls may carry data (a few "
                           f"numbers, at most {SMALL_MESSAGE} bytes, are allowed)")
    count = len(data)
    if not 2 <= count <= 4:
        mirror = "" if phase == "forward" else " (the mirror image of forward's)"
        return "count", (f"{count} all-to-all(s) carried data; the method takes 2 to 4 each way{mirror}: q, k and v "
                         "sequence-to-heads (one each, or one together) and the output heads-to-sequence")
    return "", None


def _bytes_right(g, events: list[dict], scenario: str, phase: str, world_size: int, rank: int, where: str) -> bool:
    moved = [e for e in _data(events) if is_all_to_all(e)]
    for e in moved:
        if e["kept"] * world_size != e["bytes"]:
            g.record("bytes-off-rank", False, f"{where}: an all-to-all ({_op(e)}) of {e['bytes']} bytes kept "
                     f"{e['kept']} on this rank and sent {e['sent']} to the others; each rank's own part is 1/"
                     f"{world_size} of it ({e['bytes'] // max(world_size, 1)} bytes), and only the rest leaves",
                     rank=rank, world_size=world_size)
            return False
    sent = sum(e["sent"] for e in moved)
    want = bytes_to_send(scenario, world_size)
    if sent != want:
        heads, kv_heads, _ = shapes(scenario, world_size)
        copies = replication(kv_heads, world_size)
        kv = f"{copies} x " if copies > 1 else ""
        g.record("bytes-off-rank", False,
                 f"{where}: its all-to-alls sent {sent} bytes off the rank; ({world_size} - 1) / {world_size} of q, "
                 f"{kv}k, {kv}v and the output ({heads}, {kv_heads}, {kv_heads} and {heads} heads of {CHUNK} positions, "
                 f"float64{'; gradients' if phase == 'backward' else ''}) is {want} bytes"
                 + (f" ({sent / want:.2f} times that)" if want else "") + "; " + _bytes_direction(sent, want),
                 rank=rank, world_size=world_size)
        return False
    return True


def _bytes_direction(sent: int, want: int) -> str:
    """What sends too many bytes, or too few, said for the direction the count is off in."""
    if sent > want:
        return ("too many bytes: sending the whole local tensor to every rank (and slicing there) sends W - 1 times "
                "too much; expanding k and v to every query head sends heads / kv_heads times too much")
    return ("too few bytes: some tensor (q, k, v, the output, or in backward their gradients) did not go through an "
            "all-to-all, went in a smaller dtype than float64, or k and v were not copied up to W heads where there "
            "are fewer key/value heads than ranks")


# --- memory -------------------------------------------------------------------------------------


def check_held(g, observations: list, world_size: int) -> None:
    for scenario in ("plain", "gqa", "few-kv"):
        heads, kv_heads, _ = shapes(scenario, world_size)
        share = heads_share(kv_heads, heads, world_size)
        for rank, obs in enumerate(observations):
            run = _run(obs, scenario)
            if run is None or run.get("error"):
                continue
            held = run.get("held") if isinstance(run.get("held"), dict) else {}
            most = held.get("most") if isinstance(held.get("most"), dict) else {}
            where = held.get("where") if isinstance(held.get("where"), dict) else {}
            for name in TENSORS:
                whole = most.get(name)
                if not isinstance(whole, list):
                    g.record("heads-share-held", False, f"{_said(scenario, world_size, rank)}: no record of what "
                             "it held", rank=rank, world_size=world_size)
                    return
                if len(whole) > share[name]:
                    g.record("heads-share-held", False,
                             f"{_said(scenario, world_size, rank)}: {where.get(name) or 'at one point'}, the whole "
                             f"sequence of {len(whole)} heads of {name} was in its memory at once (heads "
                             f"{', '.join(map(str, whole))}, every position found byte for byte in its variables, "
                             f"its autograd graph and what autograd saved); its share is {share[name]}",
                             rank=rank, world_size=world_size)
                    return
    g.record("heads-share-held", True)


# --- groups and refusals ------------------------------------------------------------------------


def check_group(g, observations: list, world_size: int) -> None:
    for rank, obs in enumerate(observations):
        run = _run(obs, "group")
        if run is None:
            g.not_checked("uses-group", "gqa-matches", "not run: a scenario before it failed", world_size=world_size)
            return
        members = run.get("members")
        if members not in groups_of(world_size) or rank not in members:
            g.record("uses-group", False, f"world size {world_size}, rank {rank}: no record of its group",
                     rank=rank, world_size=world_size)
            return
        size, me = len(members), members.index(rank)
        said = (f"world size {world_size}, rank {rank} in group={members} (ulysses_attention(q, k, v, group=...), "
                f"each of {groups_of(world_size)} running on its own sequence)")
        problem = f"it raised {run['error']}" if run.get("error") else None
        if problem is None:
            want = expected("group", size)
            found = _compare(run.get("output"), _chunk(want["output"], me, size), want["output"], "output")
            problem = None if found is None else (f"the output: {found}"
                                                  + _local_attention(run.get("output"), make_inputs("group", size),
                                                                     False, me, size))
        if problem is None:
            grads = _grads_problem(run, "group", me, size)
            problem = None if grads is None else f"the gradients: {grads[1]}"
        if problem is None:
            events = clean_events(run.get("forward_events", [])) or []
            events += clean_events(run.get("backward_events", [])) or []
            stray = next((e for e in _data(events) if e["group"] != members), None)
            problem = None if stray is None else (f"{_op(stray)} of {stray['bytes']} bytes ran among ranks "
                                                  f"{stray['group']}")
        if problem is not None:
            g.record("uses-group", False, f"{said}: {problem}. Rank {rank} is rank {me} of {size} there",
                     rank=rank, world_size=world_size)
            return
    g.record("uses-group", True)


def refusal_words(world_size: int, pattern: str) -> str:
    heads, kv_heads, _ = shapes(pattern, world_size)
    if pattern == "heads":
        return (f"world size {world_size}, {heads} heads ({heads} % {world_size} = {heads % world_size}) and "
                f"{kv_heads} key/value head{'s' if kv_heads > 1 else ''}, which {world_size} ranks can share: only the "
                "query heads cannot be split")
    return (f"world size {world_size}, {heads} heads and {kv_heads} key/value heads (neither {kv_heads} nor "
            f"{world_size} divides the other)")


def _refused(res) -> bool:
    """A ValueError (or an exception derived from it), as the rank saw it."""
    return isinstance(res, dict) and res.get("value_error") is True


def check_refused(g, outcome, world_size: int, pattern: str) -> None:
    """Every rank raises ValueError on shapes whose heads the ranks cannot split."""
    said = refusal_words(world_size, pattern)
    results = [r.result if r.status == "ok" and isinstance(r.result, dict) else None for r in outcome.ranks]
    refused = [rank for rank, res in enumerate(results) if _refused(res)]
    if len(refused) == world_size:
        g.record("heads-refused", True)
        return
    for rank, (res, r) in enumerate(zip(results, outcome.ranks)):
        if rank in refused:
            continue
        if res is None:
            went = _ended(rank, r)
        elif res.get("raised") == "AssertionError":
            went = (f"rank {rank} raised {_raised(res)}; an assert is not the refusal the statement asks for: "
                    "python -O removes it, and the shapes then fail by accident or not at all")
        elif res.get("raised"):
            went = f"rank {rank} raised {_raised(res)}, an accident of the shapes rather than a refusal"
        else:
            went = f"rank {rank} did not refuse: it returned an output"
        before = f"{_ranks(refused)} raised {str(results[refused[0]]['raised'])[:80]}, but " if refused else ""
        g.record("heads-refused", False, f"{said}: {before}{went}. Raise ValueError on every rank, saying the "
                 "heads (every rank sees the same shapes)", rank=rank, world_size=world_size)
        return


def _raised(res: dict) -> str:
    """The exception a rank recorded, its type named once."""
    kind, message = str(res.get("raised"))[:80], str(res.get("message"))[:300]
    return message if message.startswith(f"{kind}:") else f"{kind}: {message}"


def _ended(rank: int, r) -> str:
    err = r.error or {}
    if err:
        return f"rank {rank}'s process raised {err.get('type')}: {str(err.get('message'))[:200]}"
    said = last_words(r.output)
    return f"rank {rank}'s process ended without a result ({r.status}){'; its last output: ' + said[:200] if said else ''}"


def _ranks(numbers: list[int]) -> str:
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(map(str, numbers))


# --- the report's section -----------------------------------------------------------------------


def describe(observations: list, world_size: int) -> str:
    """One line per world size: the all-to-alls and bytes sent each way, and the most heads held whole."""

    def per_rank(values) -> str:
        return "/".join(str(v) for v in values)

    counts, sent, held = [], [], []
    for obs in observations:
        run = _run(obs, "plain") or {}
        events = [e for e in _data(clean_events(run.get("forward_events")) or []) if is_all_to_all(e)]
        counts.append(len(events))
        sent.append(sum(e["sent"] for e in events))
        held_record = run.get("held") if isinstance(run.get("held"), dict) else {}
        most = held_record.get("most")
        whole = most.get("q") if isinstance(most, dict) else None
        held.append(len(whole) if isinstance(whole, list) else "?")
    heads = shapes("plain", world_size)[0]
    return (f"{world_size} ranks (rank 0/1/...), {heads} heads: all-to-alls per forward {per_rank(counts)}, bytes "
            f"sent off-rank {per_rank(sent)} (expected {bytes_to_send('plain', world_size)}); most query heads "
            f"held whole at once {per_rank(held)} (share {heads // world_size})")
