"""Exercise 37's verdicts: pure functions of what the ranks recorded (tests/test_ex37_weight_sync.py feeds them
hand-made records). Every value a rank sent is read as untrusted: a record's fields are checked before they
are read, a tensor compared only after its type, shape and dtype are."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex37_weight_sync import DTYPES, LAYOUTS, SCENARIOS, shapes, splits, weights
from grader.checks.ex37_weight_sync.reference import (expected, kept_names, layout_bytes, pair_bytes,
                                                      placement_words)
from grader.compare import tensor_difference

SENDS, RECEIVES = ("send",), ("recv_", "recv_any_source_")


# --- reading what a rank sent -------------------------------------------------------------------


def _number(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def pushes(observations: list) -> list[dict]:
    """Each rank's pushes by (split, scenario): the records whose fields have the shapes the driver writes
    (others left out, as if not run)."""
    out = []
    for obs in observations:
        found = {}
        records = obs.get("pushes") if isinstance(obs, dict) else None
        for record in records if isinstance(records, list) else []:
            if not isinstance(record, dict) or _number(record.get("split")) is None or \
                    record.get("scenario") not in SCENARIOS or not isinstance(record.get("events"), list) or \
                    not isinstance(record.get("held"), dict):
                continue
            found[(record["split"], record["scenario"])] = record
        out.append(found)
    return out


def clean_events(events) -> list[dict] | None:
    """The c10d operations a rank recorded, each field checked; None when the record is not what the driver
    writes."""
    out = []
    for e in events if isinstance(events, list) else [None]:
        if not isinstance(e, dict) or not isinstance(e.get("op"), str) or _number(e.get("bytes")) is None:
            return None
        peer, group = e.get("peer"), e.get("group")
        if peer is not None and _number(peer) is None:
            return None
        if group is not None and not (isinstance(group, list) and all(_number(r) is not None for r in group)):
            return None
        out.append({"op": e["op"], "bytes": e["bytes"], "peer": peer, "group": group})
    return out


def data_events(events: list[dict]) -> list[dict]:
    """The messages that carried bytes: every collective (a barrier too, whatever it carries), and the sends and
    receives of more than nothing (a trainer rank holding no rows of a slice may post an empty one)."""
    return [e for e in events if e["bytes"] > 0 or e["op"] not in SENDS + RECEIVES]


# --- words ----------------------------------------------------------------------------------------


def _ordinal(n: int) -> str:
    return f"{n}{'tsnrhtdd'[(n // 10 % 10 != 1) * (n % 10 < 4) * n % 10::4]}"


def push_words(world_size: int, split_index: int, scenario: str, layout: bool = True) -> str:
    split = splits(world_size)[split_index]
    said = f" {LAYOUTS[scenario]}" if layout else ""
    return (f"world size {world_size} (trainer_ranks={split['trainers']}, inference_ranks={split['inference']}), "
            f"layout {scenario}{said} in {DTYPES[scenario]}")


def rank_words(world_size: int, split_index: int, rank: int) -> str:
    split = splits(world_size)[split_index]
    for role, ranks in (("trainer", split["trainers"]), ("inference", split["inference"])):
        if rank in ranks:
            return f"{role} rank {rank} (the {_ordinal(ranks.index(rank) + 1)} of {len(ranks)})"
    return f"rank {rank}"


def _keys(world_size: int) -> list[tuple[int, str]]:
    return [(s, scenario) for s in range(len(splits(world_size))) for scenario in SCENARIOS]


# --- what push_weights returned -------------------------------------------------------------------


def error_of(record: dict) -> str | None:
    return record["error"] if isinstance(record.get("error"), str) and record["error"] else None


def returned_problem(record: dict, world_size: int, split_index: int, scenario: str, rank: int) -> str | None:
    """What is wrong with what push_weights returned on ``rank``: None on a trainer rank; on an inference rank
    a dict with a tensor of the parameter's dtype for every parameter's name. (The slices' shapes and values
    are the checks of each push.)"""
    returned = record.get("returned") if isinstance(record.get("returned"), dict) else {}
    kind = returned.get("kind")
    if rank in splits(world_size)[split_index]["trainers"]:
        if kind != "none":
            return (f"it returned {'a dict' if kind == 'dict' else kind}; a trainer rank returns None (its weights "
                    "stay in the model)")
        return None
    if kind != "dict":
        return f"it returned {'None' if kind == 'none' else kind}, not a dict of its slices by parameter name"
    entries = returned.get("entries") if isinstance(returned.get("entries"), dict) else {}
    names = shapes(len(splits(world_size)[split_index]["inference"]))
    missing = [name for name in names if name not in entries]
    extra = [name for name in entries if name not in names]
    if missing or extra:
        said = f"it lacks {', '.join(missing[:4])}" if missing else ""
        said += ("; " if said else "") + (f"it has keys the model does not: {', '.join(extra[:4])}" if extra else "")
        return f"{said}: the dict holds one entry per model.named_parameters() name"
    for name in names:
        got = entries[name]
        if not isinstance(got, torch.Tensor):
            return f"{name} is {got}, not a tensor on this rank's device"
        if got.dtype != getattr(torch, DTYPES[scenario]):
            return f"{name} is {str(got.dtype).removeprefix('torch.')}; the parameter is {DTYPES[scenario]}"
    return None


def check_returns(g, observations: list, world_size: int) -> None:
    records = pushes(observations)
    judged, raised = False, None
    for split_index, scenario in _keys(world_size):
        for rank, found in enumerate(records):
            record = found.get((split_index, scenario))
            if record is None or error_of(record):
                raised = raised or (record is not None and (split_index, scenario))
                continue  # not run (a push before it failed), or it raised: judged by the push's own check
            judged = True
            problem = returned_problem(record, world_size, split_index, scenario, rank)
            if problem is not None:
                g.record("returns-shards", False, f"{push_words(world_size, split_index, scenario)}: "
                         f"{rank_words(world_size, split_index, rank)}: {problem}", rank=rank, world_size=world_size)
                return
    if judged:
        g.record("returns-shards", True)
    elif raised:
        g.not_checked("returns-shards", check_id_of(world_size, *raised), "push_weights raised before it returned",
                      world_size=world_size)


# --- the values --------------------------------------------------------------------------------------


def check_id_of(world_size: int, split_index: int, scenario: str) -> str:
    """Which check a push decides: the usual split's first layout shards-match, its second layout-honoured;
    the split with the trainers last rank-lists."""
    if splits(world_size)[split_index]["order"] == "reversed":
        return "rank-lists"
    return "shards-match" if scenario == SCENARIOS[0] else "layout-honoured"


def explain_values(got: torch.Tensor, name: str, world_size: int, split_index: int, scenario: str,
                   rank: int) -> str:
    """What a wrong slice holds instead, when it is something recognisable: another inference rank's slice, or
    rows of the trainer's weight other than the ones this rank keeps."""
    mine = expected(world_size, split_index, scenario)
    want = mine[rank][name]
    for other, slices in mine.items():
        if other != rank and torch.equal(slices[name], got.to(want.dtype)):
            return f"; it is the slice {rank_words(world_size, split_index, other)} keeps"
    wrong = [r for r in range(got.shape[0]) if not torch.equal(got[r].to(want.dtype), want[r])] if got.dim() else []
    if not wrong:
        return ""
    row = wrong[0]
    listed = f" (of rows {', '.join(map(str, wrong[:6]))}{' ...' if len(wrong) > 6 else ''} that differ)"
    if not torch.any(got[row]):
        return f"; its row {row}{listed} is all zeros: nothing was received there"
    if got.dim() != 2:
        return ""
    full = weights(scenario, split_index, len(splits(world_size)[split_index]["inference"]))[name]
    for start in range(full.shape[1] - got.shape[1] + 1):
        block = full[:, start:start + got.shape[1]]
        match = next((s for s in range(block.shape[0]) if torch.equal(block[s], got[row].to(want.dtype))), None)
        if match is not None:
            cols = f", columns {start}-{start + got.shape[1] - 1}," if got.shape[1] != full.shape[1] else ""
            return f"; its row {row}{listed} holds the trainer's row {match}{cols} of {name}"
    return ""


def push_problem(record: dict | None, world_size: int, split_index: int, scenario: str,
                 rank: int) -> tuple[str, str] | None:
    """("fail", words) or ("returns-shards", words) when one inference rank's slices of a push are wrong or
    cannot be compared; None when they equal the trainer's weights."""
    if error_of(record):
        return "fail", f"push_weights raised {record['error']}"
    if returned_problem(record, world_size, split_index, scenario, rank) is not None:
        return "returns-shards", f"no slices to compare on rank {rank}"
    entries = record["returned"]["entries"]
    want = expected(world_size, split_index, scenario)[rank]
    whole = shapes(len(splits(world_size)[split_index]["inference"]))
    for name, tensor in want.items():
        got = entries[name]
        if list(got.shape) != list(tensor.shape):
            return "fail", (f"{name} has shape {list(got.shape)}; this rank keeps {list(tensor.shape)} of its "
                            f"{whole[name]} ({placement_words(name, scenario)})")
        difference = tensor_difference(got, tensor, name=name)
        if difference is not None:
            return "fail", (f"{difference} against the trainer's weights ({name} is "
                            f"{placement_words(name, scenario)})"
                            f"{explain_values(got, name, world_size, split_index, scenario, rank)}")
    return None


def check_shards(g, observations: list, world_size: int) -> None:
    """shards-match, layout-honoured and rank-lists: each push's slices on every inference rank, and on a
    trainer rank that raised."""
    records = pushes(observations)
    decided: set[str] = set()
    before = None  # the check of the first push that raised: what explains the pushes never run
    for split_index, scenario in _keys(world_size):
        check_id = check_id_of(world_size, split_index, scenario)
        if check_id in decided:
            continue
        said = push_words(world_size, split_index, scenario)
        for rank in range(len(records)):
            record = records[rank].get((split_index, scenario))
            if record is None:
                if before is not None:
                    g.not_checked(check_id, before, f"{said}: not run, as a push before it failed",
                                  world_size=world_size)
                else:
                    g.record(check_id, False, f"{said}: {rank_words(world_size, split_index, rank)}: no record of "
                             "the push", rank=rank, world_size=world_size)
                decided.add(check_id)
                break
            if rank in splits(world_size)[split_index]["trainers"] and not error_of(record):
                continue
            problem = push_problem(record, world_size, split_index, scenario, rank)
            if problem is None:
                continue
            kind, words = problem
            if kind == "returns-shards":
                g.not_checked(check_id, "returns-shards", f"{said}: {words}", world_size=world_size)
            else:
                g.record(check_id, False, f"{said}: {rank_words(world_size, split_index, rank)}: {words}",
                         rank=rank, world_size=world_size)
                before = before or check_id
            decided.add(check_id)
            break
    for split_index, scenario in _keys(world_size):
        check_id = check_id_of(world_size, split_index, scenario)
        if check_id not in decided:
            decided.add(check_id)
            g.record(check_id, True)


# --- the messages ------------------------------------------------------------------------------------


def message_problem(events: list[dict], world_size: int, split_index: int, rank: int) -> str | None:
    """The first message of ``rank``'s push that is not a trainer rank's send to an inference rank (or the
    matching receive), in words."""
    split = splits(world_size)[split_index]
    trainers, inference = split["trainers"], split["inference"]
    for e in data_events(events):
        peer = e["peer"]
        if e["op"] in SENDS:
            if rank not in trainers:
                return f"it sent {e['bytes']} bytes to {rank_words(world_size, split_index, peer)}" \
                    if peer is not None else f"it sent {e['bytes']} bytes"
            if peer not in inference:
                return f"it sent {e['bytes']} bytes to {rank_words(world_size, split_index, peer)}" \
                    if peer is not None else f"it sent {e['bytes']} bytes to a rank the grader could not tell"
        elif e["op"] in RECEIVES:
            if rank not in inference:
                return f"it received {e['bytes']} bytes" + \
                    (f" from {rank_words(world_size, split_index, peer)}" if peer is not None else "")
            if peer is not None and peer not in trainers:
                return f"it received {e['bytes']} bytes from {rank_words(world_size, split_index, peer)}"
        else:
            group = f" among ranks {e['group']}" if e["group"] is not None else ""
            said = f"it ran a collective, {e['op']} of {e['bytes']} bytes{group}"
            if "barrier" in e["op"]:
                said += (": a barrier is a collective too, every rank of its group waiting for all the others, where "
                         "the statement allows none")
            return said
    return None


def completed(records: list[dict], world_size: int) -> bool:
    """Whether some push ran to its end on every rank (push_weights raised on none): what the traffic and memory
    checks judge; a push that raised on its first line sent and held nothing, which proves nothing."""
    return any(all(isinstance(found.get(key), dict) and not error_of(found[key]) for found in records) and
               len(records) == world_size for key in _keys(world_size))


def check_messages(g, observations: list, world_size: int) -> dict[tuple[int, str], bool]:
    """trainer-to-inference-only; returns, for each push, whether its messages were all a trainer rank's
    sends to inference ranks (the pushes whose bytes can be counted)."""
    records = pushes(observations)
    if not completed(records, world_size):
        g.not_checked("trainer-to-inference-only", "shards-match", f"push_weights completed no push at world size "
                      f"{world_size}", world_size=world_size)
        return {}
    clean: dict[tuple[int, str], bool] = {}
    failed = False
    for split_index, scenario in _keys(world_size):
        for rank, found in enumerate(records):
            record = found.get((split_index, scenario))
            if record is None:
                continue
            events = clean_events(record.get("events"))
            problem = "its record of messages is not the list the grader's driver writes" if events is None else \
                message_problem(events, world_size, split_index, rank)
            clean.setdefault((split_index, scenario), True)
            if problem is not None:
                clean[(split_index, scenario)] = False
                if not failed:
                    g.record("trainer-to-inference-only", False,
                             f"{push_words(world_size, split_index, scenario)}: "
                             f"{rank_words(world_size, split_index, rank)}: {problem}. The weights travel point to "
                             "point, each from a trainer rank to an inference rank",
                             rank=rank, world_size=world_size)
                    failed = True
    if not failed:
        g.record("trainer-to-inference-only", True)
    return clean


def sent_bytes(records: list[dict], world_size: int, split_index: int, scenario: str) -> dict[tuple[int, int], list]:
    """{(trainer rank, inference rank): [bytes, messages]} from the trainer ranks' sends."""
    split = splits(world_size)[split_index]
    out = {(t, i): [0, 0] for t in split["trainers"] for i in split["inference"]}
    for t in split["trainers"]:
        record = records[t].get((split_index, scenario)) if t < len(records) else None
        for e in data_events(clean_events(record.get("events")) or []) if record else []:
            if e["op"] in SENDS and (t, e["peer"]) in out:
                out[(t, e["peer"])][0] += e["bytes"]
                out[(t, e["peer"])][1] += 1
    return out


def check_bytes(g, observations: list, world_size: int, clean: dict[tuple[int, str], bool]) -> list[str]:
    """slice-bytes, for the pushes whose messages were clean; returns a line per push for the report."""
    records = pushes(observations)
    lines, failed, judged = [], False, False
    for (split_index, scenario), ok in clean.items():
        sent = sent_bytes(records, world_size, split_index, scenario)
        want = pair_bytes(world_size, split_index, scenario)
        total, layout = sum(b for b, _ in sent.values()), layout_bytes(world_size, split_index, scenario)
        said = push_words(world_size, split_index, scenario, layout=False)
        pairs = ", ".join(f"{t}->{i} {b}/{want[(t, i)]}" for (t, i), (b, _) in sent.items())
        lines.append(f"{said}: {total} bytes sent, the layout holds {layout}; {pairs}")
        if not ok:
            continue
        judged = True
        wrong = next((pair for pair in sent if sent[pair][0] != want[pair]), None)
        if wrong is not None and not failed:
            t, i = wrong
            b, n = sent[wrong]
            more = ("more: a slice sent twice, or rows or columns that rank does not keep" if b > want[wrong] else
                    "less: a slice it keeps came from another rank, or never came")
            g.record("slice-bytes", False,
                     f"{push_words(world_size, split_index, scenario)}: {rank_words(world_size, split_index, t)} "
                     f"sent {rank_words(world_size, split_index, i)} {b} bytes in {n} message(s); the rows it holds "
                     f"of what that rank keeps are {want[wrong]} bytes, {more}. In all {total} bytes went out; the "
                     f"inference layout holds {layout}", rank=t, world_size=world_size)
            failed = True
    if not failed:
        if judged:
            g.record("slice-bytes", True)
        else:
            g.not_checked("slice-bytes", "trainer-to-inference-only", "the weights did not travel from trainer "
                          "ranks to inference ranks alone", world_size=world_size)
    return lines


# --- memory ------------------------------------------------------------------------------------------


def kept_words(name: str, world_size: int, split_index: int, scenario: str, rank: int) -> str:
    """What ``rank`` keeps of parameter ``name``, in words."""
    split = splits(world_size)[split_index]
    if rank in split["trainers"]:
        return f"only its rows of it (FSDP2's Shard(0) over {len(split['trainers'])} trainer ranks)"
    return f"only its slice of it ({name} is {placement_words(name, scenario)})"


def check_held(g, observations: list, world_size: int) -> None:
    records = pushes(observations)
    if not completed(records, world_size):
        g.not_checked("holds-no-whole", "shards-match", f"push_weights completed no push at world size {world_size}",
                      world_size=world_size)
        return
    for split_index, scenario in _keys(world_size):
        for rank, found in enumerate(records):
            record = found.get((split_index, scenario))
            if record is None:
                continue
            names = shapes(len(splits(world_size)[split_index]["inference"]))
            held = {name: where for name, where in record["held"].items() if name in names}
            extra = sorted(set(held) - kept_names(world_size, split_index, scenario, rank))
            if extra:
                name = extra[0]
                where = held[name] if isinstance(held[name], str) else "at one point"
                others = f" (and {', '.join(extra[1:4])}{' ...' if len(extra) > 4 else ''})" if len(extra) > 1 else ""
                who = rank_words(world_size, split_index, rank)
                g.record("holds-no-whole", False,
                         f"{push_words(world_size, split_index, scenario)}: {who} held {name} whole{others}, {where}: "
                         "every value of it was found byte for byte in what the rank could reach, and it keeps "
                         f"{kept_words(name, world_size, split_index, scenario, rank)}",
                         rank=rank, world_size=world_size)
                return
    g.record("holds-no-whole", True)
