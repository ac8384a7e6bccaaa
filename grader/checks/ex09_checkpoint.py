"""Exercise 09: save_checkpoint / load_checkpoint.

Two runs per world size, each in a fresh process group:

* ``save_main``: train a small model with torch's DDP for two epochs, then call
  the learner's ``save_checkpoint`` with ``torch.save`` slowed down on rank 0
  (it waits until the other ranks have returned, or for SAVE_WAIT_S), recording
  every save, when each rank returned and when the write was complete. Rank 0
  also writes a reference checkpoint of its own (the grader's format, another
  epoch number) so that loading can be judged apart from saving.
* ``load_main``: the learner's ``load_checkpoint`` into a fresh plain model and
  a fresh DDP model from the reference checkpoint, with ``torch.load`` observed;
  then the resume itself: load the learner's checkpoint and train the third
  epoch, next to a run of three epochs straight.

The grader reads both checkpoint files itself and decides every check.
"""

from __future__ import annotations

import os

import torch

from grader.rank import probes, untrusted
from grader.compare import first_difference
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.drivers.ex09_checkpoint import (CHECKPOINT, EPOCHS_BEFORE_SAVE, REFERENCE, REFERENCE_EPOCH,
                                                 TOTAL_EPOCHS, load_main, save_main)


ATOL, RTOL = 1e-6, 1e-5


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        saved = g.run(save_main, world_size)
        timelines.keep(g, saved, f"the save, world size {world_size}")
        observations = saved.results()
        checkpoint_path = os.path.join(saved.run_dir, CHECKPOINT)
        reference_path = os.path.join(saved.run_dir, REFERENCE)
        stop_on_save_error(g, observations)
        check_writers(g, observations, checkpoint_path, world_size)
        check_barrier(g, observations, checkpoint_path, world_size)
        check_payload(g, observations[0], checkpoint_path, world_size)
        loaded = g.run(load_main, world_size,
                       kwargs={"checkpoint_path": checkpoint_path, "reference_path": reference_path})
        timelines.keep(g, loaded, f"the load, world size {world_size}")
        try:
            reference = untrusted.load_tensors(reference_path)
        except untrusted.Unreadable as exc:
            g.stop(f"the reference checkpoint the grader's rank 0 saved cannot be read: {exc}")
        check_loads(g, loaded.results(), reference, world_size)
        check_resume(g, loaded.results(), world_size)


def stop_on_save_error(g, observations: list[dict]) -> None:
    """Stop grading on an error in save_checkpoint, unless a rank that left early explains it.

    A barrier only rank 0 reaches fails in rank 0 once the others, back early, have
    left: barrier-after-save reports that. Any other error is the submission's own,
    and the first rank that raised names it.
    """
    errors = sorted((o["returned"], r, o["save_error"]) for r, o in enumerate(observations) if o["save_error"])
    if not errors:
        return
    done = observations[0]["write_done"]
    left_early = bool(done) and any(not o["save_error"] and o["returned"] < done[-1] for o in observations)
    if left_early:
        return
    _, rank, error = errors[0]
    g.stop(f"rank {rank}: save_checkpoint raised {error}", rank=rank)


def _name(path: str | None) -> str:
    return os.path.basename(path) if path else "a file object"


def check_writers(g, observations: list[dict], path: str, world_size: int) -> None:
    """Judged from the files written: rank 0 writes the checkpoint (directly, or through a file it
    renames onto it); no other rank writes it, in any way."""
    writers = probes.writers_of(path, [o["writes"] for o in observations])
    others = sorted(r for r in writers if r != 0)
    if others:
        rank = others[0]
        how = sorted({probes.describe_write(w, path) for w in writers[rank]})
        g.record("rank0-writes-only", False, f"rank {rank} wrote the checkpoint ({'; '.join(how)}); only rank 0 "
                 "may write", rank=rank, world_size=world_size)
    elif 0 not in writers and not untrusted.exists(path):
        saved = ", ".join(sorted({_name(s["path"]) for s in observations[0]["saves"]}))
        g.record("rank0-writes-only", False, f"rank 0 did not write {_name(path)} in save_checkpoint"
                 + (f" (torch.save went to {saved})" if saved else ""), rank=0, world_size=world_size)
    g.record("rank0-writes-only", True)


def check_barrier(g, observations: list[dict], path: str, world_size: int) -> bool:
    """Record barrier-after-save; False when it failed (the message names any error save_checkpoint raised)."""
    errors = "".join(f"; rank {r}'s save_checkpoint raised {o['save_error']}"
                     for r, o in enumerate(observations) if o["save_error"])
    done = observations[0]["write_done"]
    if not done or not untrusted.is_regular(path):
        return g.record("barrier-after-save", False, f"no checkpoint was written to {_name(path)}, so no rank "
                        f"can wait for it{errors}", world_size=world_size)
    complete_at, size = done[-1], untrusted.lstat(path).st_size
    ok = True
    for rank, obs in enumerate(observations):
        early = complete_at - obs["returned"]
        had = obs["size_at_return"]
        if early > 0:
            ok = g.record("barrier-after-save", False,
                          f"rank {rank} returned from save_checkpoint while rank 0 was still writing the file "
                          f"({early * 1000:.0f} ms before it was complete; it had "
                          f"{'no file' if had is None else f'{had} of {size} bytes'} then){errors}",
                          rank=rank, world_size=world_size)
        elif had != size:
            ok = g.record("barrier-after-save", False,
                          f"when rank {rank} returned from save_checkpoint the file had {had} bytes; the complete "
                          f"file has {size}{errors}", rank=rank, world_size=world_size)
    return g.record("barrier-after-save", True) and ok


def _read_checkpoint(path: str):
    try:
        return untrusted.load_tensors(path), None
    except untrusted.Unreadable as exc:  # a missing or corrupt file is the observation
        return None, str(exc)


def check_payload(g, obs: dict, path: str, world_size: int) -> None:
    checkpoint, error = _read_checkpoint(path)
    if error is not None:
        message = f"the checkpoint {_name(path)} could not be read: {error}"
        g.record("payload-keys", False, message, world_size=world_size)
        g.record("no-module-prefix", False, message, world_size=world_size)
        return
    if not isinstance(checkpoint, dict):
        message = f"the checkpoint holds a {type(checkpoint).__name__}, expected a dict"
        g.record("payload-keys", False, message, world_size=world_size)
        g.record("no-module-prefix", False, message, world_size=world_size)
        return
    keys = sorted(str(k) for k in checkpoint)
    missing = [k for k in ("model", "optimizer", "epoch") if k not in checkpoint]
    if missing:
        g.record("payload-keys", False, f"the checkpoint's keys are {keys}; missing {missing} "
                 "(expected 'model', 'optimizer' and 'epoch')", world_size=world_size)
    else:
        epoch = checkpoint["epoch"]
        expected_epoch = EPOCHS_BEFORE_SAVE - 1
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch != expected_epoch:
            g.record("payload-keys", False, f"checkpoint['epoch'] is {epoch!r}; save_checkpoint was called with "
                     f"epoch={expected_epoch}", world_size=world_size)
        problem = _optimizer_difference(checkpoint["optimizer"], obs["optimizer_state"])
        if problem:
            g.record("payload-keys", False, f"checkpoint['optimizer'] is not rank 0's optimizer.state_dict(): "
                     f"{problem}", world_size=world_size)
        g.record("payload-keys", True)

    model_state = checkpoint.get("model")
    if "model" not in checkpoint:  # judge the prefix on whatever looks like the model's state_dict
        model_state = next((v for v in checkpoint.values() if isinstance(v, dict) and v and
                            all(isinstance(t, torch.Tensor) for t in v.values())), None)
    if not isinstance(model_state, dict):
        g.record("no-module-prefix", False, f"the checkpoint holds no model state_dict (keys: {keys})",
                 world_size=world_size)
        return
    prefixed = [k for k in model_state if str(k).startswith("module.")]
    if prefixed:
        g.record("no-module-prefix", False, f"{len(prefixed)} of {len(model_state)} keys start with 'module.' "
                 f"(e.g. {prefixed[0]!r}): that is the DDP wrapper's state_dict", world_size=world_size)
        return
    problem = _state_difference(model_state, obs["module_state"])
    g.record("no-module-prefix", problem is None,
             f"checkpoint['model'] is not rank 0's unwrapped model: {problem}", world_size=world_size)


def _state_difference(got: dict, expected: dict) -> str | None:
    """None when two state_dicts hold the same keys and equal tensors, else what differs."""
    if set(got) != set(expected):
        extra = sorted(set(map(str, got)) - set(expected))
        missing = sorted(set(expected) - set(map(str, got)))
        return f"keys missing {missing[:4]}, unexpected {extra[:4]}"
    found = first_difference(got, expected)
    if found is None:
        return None
    if found.reason in ("shape", "not a tensor"):
        return f"{found.name!r} has shape {getattr(got[found.name], 'shape', None)}, expected " \
               f"{tuple(expected[found.name].shape)}"
    return f"{found.name!r} differs by up to {found.max_abs:.3g}"


def _optimizer_difference(got, expected: dict) -> str | None:
    """None when an optimizer state_dict holds the expected per-parameter state, else what differs."""
    if not isinstance(got, dict) or "state" not in got or "param_groups" not in got:
        return f"it is {type(got).__name__} with keys {sorted(map(str, got))[:6] if isinstance(got, dict) else []}"
    state, expected_state = got["state"], expected["state"]
    if len(state) != len(expected_state):
        return f"it holds state for {len(state)} parameter(s), expected state for {len(expected_state)}"
    for index, entry in expected_state.items():
        if index not in state:
            return f"no state for parameter {index}"
        for name, value in entry.items():
            other = state[index].get(name) if isinstance(state[index], dict) else None
            if isinstance(value, torch.Tensor):
                if not isinstance(other, torch.Tensor) or other.shape != value.shape or \
                        not torch.equal(other.to(value.dtype), value):
                    return f"state[{index}][{name!r}] differs"
            elif other != value:
                return f"state[{index}][{name!r}] is {other!r}, expected {value!r}"
    return None


def check_loads(g, observations: list[dict], reference: dict, world_size: int) -> None:
    expected_start = REFERENCE_EPOCH + 1
    returned = 0
    for rank, obs in enumerate(observations):
        for name in ("plain", "wrapped"):
            scenario = obs[name]
            into = "a plain model" if name == "plain" else "a DDP-wrapped model"
            if scenario["error"]:
                g.record("load-restores", False, f"rank {rank}: load_checkpoint into {into} raised "
                         f"{scenario['error']} (the checkpoint given held the keys {sorted(reference)})",
                         rank=rank, world_size=world_size)
                continue
            returned += 1
            start = scenario["start"]
            g.record("returns-next-epoch", type(start) is int and start == expected_start,
                     f"rank {rank}: the checkpoint says epoch {REFERENCE_EPOCH} is finished; load_checkpoint "
                     f"into {into} returned {start!r}, expected {expected_start}", rank=rank, world_size=world_size)
            problem = _state_difference(scenario["model_state"], reference["model"])
            if problem:
                g.record("load-restores", False, f"rank {rank}: after load_checkpoint into {into}, the model is "
                         f"not the checkpoint's: {problem}", rank=rank, world_size=world_size)
            problem = _optimizer_difference(scenario["optimizer_state"], reference["optimizer"])
            if problem:
                g.record("load-restores", False, f"rank {rank}: after load_checkpoint into {into}, the optimizer "
                         f"state_dict differs from the checkpoint's: {problem}", rank=rank, world_size=world_size)
    g.record("load-restores", True)
    if not returned:
        error = observations[0]["plain"]["error"]
        g.record("returns-next-epoch", False, f"load_checkpoint never returned: it raised {error}",
                 world_size=world_size)
    g.record("returns-next-epoch", True)

    for rank, obs in enumerate(observations):
        if not obs["loads"]:
            g.record("map-location", False, f"rank {rank}: load_checkpoint never called torch.load",
                     rank=rank, world_size=world_size)
        for call in obs["loads"]:
            if call["map_location"] is None:
                g.record("map-location", False, f"rank {rank} called torch.load without map_location: tensors "
                         "come back on the device they were saved from (rank 0's)", rank=rank, world_size=world_size)
                break
            # The CPU is fine too: load_state_dict copies onto the parameters' device.
            wrong = [d for d in call["devices"] if d not in (obs["device"], "cpu")]
            if wrong:
                g.record("map-location", False, f"rank {rank}: torch.load(map_location={call['map_location']}) "
                         f"put tensors on {wrong}, this rank's device is {obs['device']}",
                         rank=rank, world_size=world_size)
                break
    g.record("map-location", True)


def check_resume(g, observations: list[dict], world_size: int) -> None:
    for rank, obs in enumerate(observations):
        resume = obs["resume"]
        if resume["error"]:
            g.record("resume-equals-straight", False, f"rank {rank}: load_checkpoint of the checkpoint that "
                     f"save_checkpoint wrote raised {resume['error']}", rank=rank, world_size=world_size)
            continue
        epochs = resume["epochs"]
        trained = f"epochs {epochs}" if epochs else "no epoch"
        for key, expected in obs["straight"].items():
            got = resume["model_state"][key]
            diff = (got.double() - expected.double()).abs()
            if not torch.all(diff <= ATOL + RTOL * expected.double().abs()):
                g.record("resume-equals-straight", False,
                         f"rank {rank}: trained {EPOCHS_BEFORE_SAVE} epochs, saved, loaded in a new process group "
                         f"(load_checkpoint returned {resume['start']!r}) and trained {trained}: {key!r} differs "
                         f"from {TOTAL_EPOCHS} epochs straight by up to {diff.max().item():.3g}",
                         rank=rank, world_size=world_size)
                break
    g.record("resume-equals-straight", True)
