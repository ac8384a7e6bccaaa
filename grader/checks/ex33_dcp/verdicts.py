"""Exercise 33's verdicts, from the ranks' records (grader side): the group the background saves
talk on, whether a save returns before its files are written and waits for the save before it,
which rank wrote which shard, what the ranks held in memory, and the loads on other world sizes
(the step returned, the parameters and optimizer state loaded, the steps after, the load that
follows a killed save).

A save job's record (one per rank, in rank order; rank.py writes it): ``saves`` (each call of
save: folder, step, called, returned, error, next_step_started, threads: the keys of the threads
it started), ``writes`` (op: open, rename, torch.save or held; path, src, folder, t, thread, main),
``collectives`` (op, t, t_end, thread, main, training_group, refused), ``memory`` (call, where,
names), ``params`` ({step: {name: local shard}}) and ``optimizer`` ({name: {exp_avg, exp_avg_sq,
step}} at the newest resume save). A load job's record: ``resume`` and ``kill`` (returned, error,
params, optimizer; ``final``, the parameters after the steps that follow) and ``memory``."""

from __future__ import annotations

import math
import os

import torch

from grader.rank.drivers.ex33_dcp import KILL, RESUME
from grader.checks.interface import Grader
from grader.compare import first_difference
from grader.rank.memory import tensor_bytes

LOADED_ATOL = 1e-6  # a load copies the saved bytes: nothing but rounding-free copies
RESUMED_ATOL, RESUMED_RTOL = 1e-5, 1e-4  # steps on another world size sum the gradients in another order
AFTER_GROUP = ("async-save", "waits-previous", "own-shards", "whole-model", "returns-step", "resharded-resume",
               "optimizer-state", "survives-kill")


def _shape(shape) -> str:
    return "x".join(map(str, shape))


# --- putting the ranks' shards together -----------------------------------------------------------------


def assemble(parts: list[dict], shapes: dict) -> dict:
    """Each parameter whole from every rank's local values: the dim-0 shards in rank order (or, when a
    rank holds the whole of it, rank 0's). Parameters some rank lacks are left out."""
    out = {}
    for name, shape in shapes.items():
        pieces = [p.get(name) if isinstance(p, dict) else None for p in parts]
        if any(not isinstance(x, torch.Tensor) for x in pieces):
            continue
        if tuple(pieces[0].shape) == tuple(shape):
            out[name] = pieces[0]
        elif all(x.dim() == len(shape) for x in pieces):
            out[name] = torch.cat(pieces, dim=0)
    return out


def assemble_optimizer(parts: list[dict], shapes: dict) -> dict:
    """Each parameter's optimizer state whole: {name: {key: tensor or float}}."""
    out = {}
    for name, shape in shapes.items():
        states = [p.get(name) if isinstance(p, dict) else None for p in parts]
        if any(not isinstance(s, dict) for s in states):
            continue
        entry = {}
        for key, value in states[0].items():
            if isinstance(value, torch.Tensor):
                whole = assemble([{name: s.get(key)} for s in states], {name: shape})
                if name in whole:
                    entry[key] = whole[name]
            else:
                entry[key] = value
        out[name] = entry
    return out


def expected_states(records: list[dict], shapes: dict) -> dict:
    """What the job that never stopped held: its parameters after each recorded step, its optimizer
    state at the newest resume save."""
    steps = sorted(set.intersection(*(set(r["params"]) for r in records)))
    return {"params": {step: assemble([r["params"][step] for r in records], shapes) for step in steps},
            "optimizer": assemble_optimizer([r["optimizer"] or {} for r in records], shapes)}


def identify(got: dict, known: dict) -> str | None:
    """The label of the state in ``known`` that ``got`` equals (None when none)."""
    for label, state in known.items():
        if got and state and first_difference(got, state, atol=LOADED_ATOL) is None:
            return label
    return None


# --- the save job ---------------------------------------------------------------------------------------


def activity(record: dict) -> list[list[dict]]:
    """For each save call of a rank, in order, the events that belong to it: the writes and the collectives
    of the threads it started, and those of the main thread while it ran. An event of a thread no save
    started (one a save's thread started itself) goes to the latest save called before it."""
    saves = record["saves"]
    owner = {key: i for i, entry in enumerate(saves) for key in entry["threads"]}
    out: list[list[dict]] = [[] for _ in saves]
    events = [dict(w, kind="write") for w in record["writes"]] + \
        [dict(c, kind="collective") for c in record["collectives"]]
    for event in events:
        if event["main"]:
            index = next((i for i, s in enumerate(saves)
                          if s["called"] <= event["t"] <= (s["returned"] or math.inf)), None)
        else:
            index = owner.get(event["thread"])
            if index is None:
                index = max((i for i, s in enumerate(saves) if s["called"] <= event["t"]), default=None)
        if index is not None:
            out[index].append(event)
    return out


def _call(entry: dict) -> str:
    return f"save(path, model, optimizer, step={entry['step']})"


def check_own_group(g: Grader, records: list[dict], world_size: int) -> bool:
    """The background saves talk on a group of their own; False (and every later check not decided) if not."""
    for rank, record in enumerate(records):
        owner = {key: entry for entry in record["saves"] for key in entry["threads"]}
        refused = next((c for c in record["collectives"] if c.get("refused")), None)
        if refused is not None:
            entry = owner.get(refused["thread"])
            during = f" of {_call(entry)}" if entry else ""
            return g.record("own-group", False,
                            f"rank {rank}: the background thread{during} called torch.distributed.{refused['op']} on the "
                            "process group training uses, while training's collectives run on it from the main thread: "
                            "the two threads' collectives pair up in different orders on different ranks, and gloo "
                            "aborts the process or the job hangs (the grader refused the call, so the save failed). "
                            "Make a group for the saves once, dist.new_group(backend='gloo'), and pass it to "
                            "dcp.async_save as process_group=", rank=rank, world_size=world_size)
        failed = next((e for e in record["saves"] if e["error"] and "CPU backend must be enabled" in e["error"]), None)
        if failed is not None:
            return g.record("own-group", False, f"rank {rank}: {_call(failed)} raised {failed['error']}: the default "
                            "group is NCCL's; give the background save a gloo group of its own, "
                            "dist.new_group(backend='gloo')", rank=rank, world_size=world_size)
    return g.record("own-group", True)


def first_save_error(records: list[dict]) -> tuple[int, dict] | None:
    """The rank and save call that raised first (by when it returned), or None."""
    failed = [(entry["returned"] or math.inf, rank, entry) for rank, record in enumerate(records)
              for entry in record["saves"] if entry["error"]]
    return (min(failed, key=lambda f: f[0])[1], min(failed, key=lambda f: f[0])[2]) if failed else None


def check_async(g: Grader, records: list[dict], world_size: int) -> None:
    """Each save into the resume folder returns before its checkpoint is complete, and the next step
    starts before then (the disk holds a background thread's first write HOLD_S)."""
    events = [activity(record) for record in records]
    for index, entry in enumerate(records[0]["saves"]):
        if entry["folder"] != RESUME:
            continue
        writes = [e for per_rank in events for e in per_rank[index] if e["kind"] == "write"]
        if not writes:
            g.record("async-save", False, f"{_call(entry)} wrote no file under path on any rank",
                     world_size=world_size)
            continue
        complete = max(e["t"] for e in writes)
        for rank, record in enumerate(records):
            mine = record["saves"][index]
            called, returned, started = mine["called"], mine["returned"], mine["next_step_started"]
            if complete <= returned:
                g.record("async-save", False,
                         f"rank {rank}: {_call(mine)} returned {returned - called:.2f} s after it was called, when its "
                         f"checkpoint was already written (the last file {complete - called:.2f} s after the call): step "
                         f"{mine['step'] + 1} waited for the disk. dcp.async_save returns once the state is staged "
                         "(copied); keep its future, and wait for it before the next save, not before returning",
                         rank=rank, world_size=world_size)
                break
            if started is None or started >= complete:
                when = "never" if started is None else f"{started - called:.2f} s after the call"
                g.record("async-save", False,
                         f"rank {rank}: step {mine['step'] + 1} started {when}, after the checkpoint of {_call(mine)} "
                         f"was complete ({complete - called:.2f} s after the call): return from save as soon as "
                         "dcp.async_save has, so that the step runs while the files are written",
                         rank=rank, world_size=world_size)
                break
    g.record("async-save", True)


def check_waits(g: Grader, records: list[dict], world_size: int) -> None:
    """A save starts its background work (collectives, files) only once the save before it is done."""
    for rank, record in enumerate(records):
        per_save = activity(record)
        saves = record["saves"]
        for index in range(1, len(saves)):
            # A save ends with its last collective (its writes come before it): a file its thread renames
            # once its future is done, as the next save starts, is no second save in flight.
            before = [e for e in per_save[index - 1] if e["kind"] == "collective"] or per_save[index - 1]
            after = [e for e in per_save[index] if e["kind"] == "write" or not e["main"]]
            if not before or not after:
                continue
            last = max(before, key=lambda e: e.get("t_end") or e["t"])
            first = min(after, key=lambda e: e["t"])
            if first["t"] < (last.get("t_end") or last["t"]):
                entry, previous = saves[index], saves[index - 1]
                called = entry["called"]
                g.record("waits-previous", False,
                         f"rank {rank}: {_call(entry)} began ({_event(first)} {first['t'] - called:.2f} s after it was "
                         f"called) while {_call(previous)} was still running ({_event(last)} "
                         f"{(last.get('t_end') or last['t']) - called:+.2f} s): two saves in flight at once, their "
                         "collectives on one group from two threads and two staged copies of the state. Wait for the "
                         "previous save's future (.result()) before starting the next", rank=rank, world_size=world_size)
                break
    g.record("waits-previous", True)


def _event(event: dict) -> str:
    if event["kind"] == "collective":
        return f"its {event['op']}"
    what = {"open": "opened", "rename": "renamed onto", "torch.save": "torch.save to", "held": "wrote"}[event["op"]]
    return f"it {what} {os.path.basename(event['path'])}"


def moved(path: str, renames: list[dict]) -> str:
    """Where ``path`` ended up after ``renames`` (in order): of the file itself, or of a folder above it."""
    for rename in renames:
        source = rename.get("src")
        if source and (path == source or path.startswith(os.path.join(source, ""))):
            path = rename["path"] + path[len(source):]
    return path


def written_files(records: list[dict], index: int) -> list[list[str]]:
    """For each rank, the files its save call ``index`` wrote, where they ended up (renames followed)."""
    renames = sorted((w for record in records for w in record["writes"] if w["op"] == "rename"), key=lambda w: w["t"])
    out = []
    for record in records:
        paths = set()
        for event in activity(record)[index]:
            if event["kind"] == "write" and event["op"] in ("open", "torch.save", "rename"):
                paths.add(moved(event["path"], [r for r in renames if r["t"] >= event["t"]]))
        out.append(sorted(paths))
    return out


def check_own_shards(g: Grader, records: list[dict], files: dict[str, bytes], world_size: int,
                     names: list[str]) -> None:
    """In the newest resume save, every rank wrote its own shard of each large parameter, and no other
    rank's: found byte for byte in the files each rank wrote (``files``: their contents, by path)."""
    index = max(i for i, e in enumerate(records[0]["saves"]) if e["folder"] == RESUME)
    entry = records[0]["saves"][index]
    written = written_files(records, index)
    contents = [[files.get(path, b"") for path in paths] for paths in written]
    for rank, paths in enumerate(written):
        if not paths:
            g.record("own-shards", False, f"rank {rank} wrote no file in {_call(entry)}: every rank writes its own "
                     "shards (dcp.save or dcp.async_save, called on every rank, with the sharded state dicts)",
                     rank=rank, world_size=world_size)
            return
    for name in names:
        for rank, record in enumerate(records):
            # This rank's shard as at any recorded step: who wrote it is judged here, when is resharded-resume's.
            shards = [tensor_bytes(params[name]) for _, params in sorted(record["params"].items())]
            holders = [q for q in range(len(records)) if any(shard in data for data in contents[q] for shard in shards)]
            if rank not in holders:
                if holders:
                    message = (f"rank {holders[0]} wrote rank {rank}'s shard of {name!r} in {_call(entry)}, and rank "
                               f"{rank} did not: the shards were gathered onto rank {holders[0]}")
                else:
                    shown = ", ".join(os.path.basename(p) for p in written[rank][:3])
                    message = (f"rank {rank}'s shard of {name!r} (as after step {entry['step']}, or any step near it) is "
                               f"in none of the files rank {rank} wrote in {_call(entry)} ({shown})")
                g.record("own-shards", False, message + ". Save get_state_dict's sharded state dicts with DCP on "
                         "every rank", rank=rank, world_size=world_size)
                return
            others = [q for q in holders if q != rank]
            if others:
                g.record("own-shards", False, f"rank {others[0]} also wrote rank {rank}'s shard of {name!r} in "
                         f"{_call(entry)}: each rank writes its own shards, and only those", rank=others[0],
                         world_size=world_size)
                return
    g.record("own-shards", True)


def check_memory(g: Grader, held: list[dict], shapes: dict, world_sizes: list[int]) -> None:
    """No rank held a whole large parameter while the learner's save or load ran. ``held``: the ranks'
    memory records, each with its ``world_size`` and ``rank``. A rank alone holds the whole model as its
    shard: its records say nothing."""
    if max(world_sizes) < 2:
        g.skip("whole-model", "a rank alone holds every parameter whole as its shard: needs 2 ranks or more")
        return
    for entry in held:
        if entry["world_size"] < 2:
            continue
        names = entry["names"]
        g.record("whole-model", False,
                 f"rank {entry['rank']} of {entry['world_size']} held the whole of {names[0]!r} ({_shape(shapes[names[0]])})"
                 + (f" and {len(names) - 1} more parameter(s)" if len(names) > 1 else "")
                 + f" while {entry['call']} ran ({entry['where']}): a rank holds its shards, never the whole model. "
                 "Save and load the sharded state dicts of get_state_dict (full_state_dict=False, the default) with DCP",
                 rank=entry["rank"], world_size=entry["world_size"])
        return
    g.record("whole-model", True)


# --- the load jobs --------------------------------------------------------------------------------------


def _raised(loads: list[dict], folder: str) -> tuple[int, str] | None:
    return next(((rank, load[folder]["error"]) for rank, load in enumerate(loads) if load[folder]["error"]), None)


def check_returns_step(g: Grader, loads: list[dict], step: int, world_size: int) -> None:
    for rank, load in enumerate(loads):
        entry = load[RESUME]
        if entry["error"]:
            g.record("returns-step", False, f"rank {rank} of {world_size}: load raised {entry['error']}",
                     rank=rank, world_size=world_size)
            return
        returned = entry["returned"]
        if type(returned) is not int or returned != step:
            g.record("returns-step", False,
                     f"rank {rank} of {world_size}: load returned {returned!r}; the newest complete checkpoint under "
                     f"path is the one saved after step {step} (saved after steps {step - 1} and {step}: compare the "
                     "steps as numbers, or pad the folder names)", rank=rank, world_size=world_size)
            return
    g.record("returns-step", True)


def _which(got: dict, expected: dict, initial: dict, step: int) -> str:
    """What a loaded state is, in words, when it is not the checkpoint of ``step``."""
    known = {f"the job's parameters after step {s}": state for s, state in expected["params"].items() if s != step}
    known["the fresh model's parameters"] = initial
    label = identify(got, known)
    if label is None:
        found = first_difference(got, expected["params"][step], atol=LOADED_ATOL)
        return f"not the checkpoint's parameters: {found.describe()}" if found else "the checkpoint's parameters"
    if "fresh" in label:
        return f"{label}: load restored nothing into the model"
    later = int(label.rsplit(" ", 1)[1]) > step
    return label + (": the save wrote the live parameters after training had changed them; dcp.async_save stages "
                    "(copies) them before it returns" if later else f": an older checkpoint than step {step}'s")


def check_resume(g: Grader, loads: list[dict], expected: dict, initial: dict, shapes: dict, step: int,
                 last: int, save_size: int, world_size: int) -> None:
    """Loaded on ``world_size`` ranks from ``save_size``: the parameters are the checkpoint's, and the
    steps after it end where the job that never stopped did."""
    raised = _raised(loads, RESUME)
    if raised:
        g.record("resharded-resume", False, f"rank {raised[0]} of {world_size}: load of the checkpoint {save_size} "
                 f"ranks saved raised {raised[1]}", rank=raised[0], world_size=world_size)
        return
    loaded = assemble([load[RESUME]["params"] for load in loads], shapes)
    if first_difference(loaded, expected["params"][step], atol=LOADED_ATOL) is not None:
        g.record("resharded-resume", False, f"after load on {world_size} ranks (saved by {save_size}) the model holds "
                 f"{_which(loaded, expected, initial, step)}", world_size=world_size)
        return
    final = assemble([load[RESUME].get("final") or {} for load in loads], shapes)
    found = first_difference(final, expected["params"][last], atol=RESUMED_ATOL, rtol=RESUMED_RTOL)
    g.record("resharded-resume", found is None,
             f"loaded on {world_size} ranks (saved by {save_size}), the model was the checkpoint's, but after steps "
             f"{step + 1}-{last} it differs from the job that never stopped: {found}", world_size=world_size)


def check_optimizer(g: Grader, loads: list[dict], expected: dict, shapes: dict, step: int, world_size: int) -> None:
    """After the load, the optimizer's state (AdamW: exp_avg, exp_avg_sq, step) is the checkpoint's."""
    raised = _raised(loads, RESUME)
    if raised:
        g.not_checked("optimizer-state", "resharded-resume", f"load raised on rank {raised[0]}", world_size=world_size)
        return
    got = assemble_optimizer([load[RESUME]["optimizer"] for load in loads], shapes)
    for name, want in expected["optimizer"].items():
        have = got.get(name) or {}
        missing = [key for key in want if key not in have]
        if missing:
            g.record("optimizer-state", False,
                     f"after load on {world_size} ranks the optimizer has no {', '.join(missing)} for {name!r}"
                     + (" (it is a fresh AdamW)" if not have else "")
                     + ": save the optimizer's state dict with the model's, and load it (get_state_dict / set_state_dict)",
                     world_size=world_size)
            return
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                found = first_difference({key: have[key]}, {key: value}, atol=LOADED_ATOL)
                if found is not None:
                    g.record("optimizer-state", False, f"after load on {world_size} ranks the optimizer's state of "
                             f"{name!r} is not the checkpoint's: {found}", world_size=world_size)
                    return
            elif have[key] != value:
                g.record("optimizer-state", False, f"after load on {world_size} ranks AdamW's {key} for {name!r} is "
                         f"{have[key]!r}; the checkpoint of step {step} holds {value!r}", world_size=world_size)
                return
    g.record("optimizer-state", True)


def check_kill(g: Grader, loads: list[dict], expected: dict, initial: dict, notes: dict[int, str], step: int,
               world_size: int) -> None:
    """After a save killed half-way, load gives the checkpoint before it. ``notes``: the file each rank
    was opening when it was killed."""
    how = "; ".join(f"rank {rank} as it opened {os.path.basename(path)} for writing" if path else
                    f"rank {rank} before it renamed a file" for rank, path in sorted(notes.items())) or "every rank"
    killed = f"the save after step {step + 1} was killed half-way ({how})"
    raised = _raised(loads, KILL)
    if raised:
        g.record("survives-kill", False, f"{killed}; then load on {world_size} ranks raised {raised[1]}",
                 rank=raised[0], world_size=world_size)
        return
    for rank, load in enumerate(loads):  # any other wrong step is returns-step's
        if load[KILL]["returned"] == step + 1:
            g.record("survives-kill", False, f"{killed}; then load on rank {rank} of {world_size} returned {step + 1}, "
                     f"the killed save's step: take only folders whose save finished (with a .metadata file)",
                     rank=rank, world_size=world_size)
            return
    shapes = {name: tuple(t.shape) for name, t in expected["params"][step].items()}
    loaded = assemble([load[KILL]["params"] for load in loads], shapes)
    g.record("survives-kill", first_difference(loaded, expected["params"][step], atol=LOADED_ATOL) is None,
             f"{killed}; then load on {world_size} ranks gave a model holding "
             f"{_which(loaded, expected, initial, step)}", world_size=world_size)
