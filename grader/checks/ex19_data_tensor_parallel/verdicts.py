"""Exercise 19's verdicts, from the records of rank.py (pure: tests/test_ex19_data_tensor_parallel.py
feeds them hand-made records).

A rank's timeline holds its forwards (the batch, the parameters at that moment) and its collectives
(the group's global ranks, bytes, whether a forward was running, whether the parameters had changed
since the last forward began). Phases, as the verdicts read them:

* in forward: the MLP's all-reduce, which belongs to the tensor-parallel group;
* the gradient phase (after a forward, the parameters not yet changed): backward and the gradient
  reductions, which belong to the data-parallel group; collectives of at most SMALL_MESSAGE bytes (a
  loss for logging) may run anywhere;
* before the first forward (making groups, the model) and after the last update (gathering the state
  dict): not judged by groups; the result is."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex19_data_tensor_parallel import (IN_FEATURES, LR, PARAMETERS, SMALL_MESSAGE, STATE_KEYS,
                                                          STEPS, groups_of, make_data)
from grader.checks.ex19_data_tensor_parallel.reference import local_block
from grader.checks.interface import Grader
from grader.compare import tensor_difference

RTOL, ATOL = 1e-9, 1e-9  # float64, a few steps: the sums differ in order only
ROW_MATCH = 1e-12  # a batch row is a row of data when it is within this of it (relative)
ERROR_MARKS = ("by peer", "timed out", "timeout", "Timed out")  # a peer left waiting: a consequence


# --- reading the records ------------------------------------------------------------------------------


def _first_error(observations: list[dict], key: str) -> tuple[int, dict] | None:
    """The first rank whose ``key`` error is a cause, not a peer left waiting."""
    failed = [(rank, o[key]) for rank, o in enumerate(observations) if o.get(key)]
    if not failed:
        return None
    failed.sort(key=lambda item: any(m in item[1]["message"] for m in ERROR_MARKS))
    return failed[0]


def _said(error: dict) -> str:
    return f"{error['type']}: {error['message']}" + (f" ({error['line']})" if error.get("line") else "")


def training_forwards(timeline: list[dict]) -> list[dict]:
    return [e for e in timeline if e.get("kind") == "forward" and e.get("grad")]


def steps_of(timeline: list[dict]) -> list[list[dict]]:
    """The training forwards grouped into steps: forwards with the same parameters are one step."""
    steps: list[list[dict]] = []
    previous = None
    for e in training_forwards(timeline):
        params = e.get("params") or {}
        same = previous is not None and params.keys() == previous.keys() and \
            all(torch.equal(params[k], previous[k]) for k in params)
        if same and steps:
            steps[-1].append(e)
        else:
            steps.append([e])
        previous = params
    return steps


def step_batch(step: list[dict]) -> torch.Tensor | None:
    inputs = [e["input"] for e in step if isinstance(e.get("input"), torch.Tensor)]
    if not inputs:
        return None
    return torch.cat([t.reshape(-1, t.shape[-1]).double() for t in inputs])


def row_indices(batch: torch.Tensor, data: torch.Tensor) -> list[int | None]:
    """For each row of ``batch``, the index of the equal row of ``data`` (None when there is none)."""
    if batch.shape[-1] != data.shape[-1]:
        return [None] * batch.shape[0]
    scale = float(data.abs().max())
    distance = (batch[:, None, :] - data[None, :, :]).abs().amax(dim=-1)
    best, index = distance.min(dim=1)
    return [int(i) if float(b) <= ROW_MATCH * scale else None for b, i in zip(best, index)]


def _rows(indices: list[int]) -> str:
    return "[" + ", ".join(map(str, indices[:12])) + (", ..." if len(indices) > 12 else "") + "]"


def gradient_phase(event: dict) -> bool:
    """A collective between a forward and the next change of the parameters (backward, gradient reductions)."""
    return event.get("kind") == "collective" and not event.get("in_forward") and event.get("after_forwards", 0) > 0 \
        and event.get("updated") is False


def _what(event: dict) -> str:
    return f"dist.{event['op']} of {event['bytes']} bytes"


def _group_words(group: list[int], world_size: int) -> str:
    return f"ranks {group}" + (" (the whole world)" if group == list(range(world_size)) and world_size > 1 else "")


# --- make_groups -----------------------------------------------------------------------------------------


def new_group_calls(obs: dict) -> str:
    calls = [c["ranks"] for c in obs.get("new_groups") or [] if not c.get("local")]
    return ", ".join(f"new_group({r})" for r in calls) or "no new_group call"


def check_group_calls(g: Grader, observations: list[dict], world_size: int) -> bool:
    """Every rank made every group, in the same order; False when the watch saw calls that differ."""
    for rank, obs in enumerate(observations):
        for key, where in (("groups_error", "make_groups"), ("train_error", "train_2d")):
            error = obs.get(key)
            if error and error.get("group_calls"):
                listing = "" if "differ" in error["message"] else ". The calls made: " + "; ".join(
                    f"rank {r}: {new_group_calls(o)}" for r, o in enumerate(observations))
                g.record("same-group-calls", False,
                         f"world size {world_size}, rank {rank}, in {where}: {error['message']}"
                         + (f" ({error['line']})" if error.get("line") else "") + f"{listing}. "
                         "torch names a group by how many were made before it (without use_local_synchronization=True): "
                         "a rank that skips a group it is not in pairs its next group with another rank's different "
                         "one, and gloo waits for peers that never come", rank=rank, world_size=world_size)
                return False
    g.record("same-group-calls", True)
    return True


def check_members(g: Grader, observations: list[dict], world_size: int, tp_size: int) -> bool:
    """make_groups returned this rank's (dp_group, tp_group), each joining exactly its ranks."""
    for rank, obs in enumerate(observations):
        want_dp, want_tp = groups_of(rank, world_size, tp_size)
        layout = (f"(world size {world_size}, tp_size {tp_size}: tensor-parallel groups are consecutive ranks, "
                  f"rank {rank}'s {want_tp}; data-parallel groups one rank of each, rank {rank}'s {want_dp})")
        error = obs.get("groups_error")
        problem = None
        if error:
            problem = f"make_groups({world_size}, {tp_size}) raised {_said(error)}"
        elif obs.get("groups") is None:
            problem = "make_groups did not return"
        elif obs["groups"].get("shape"):
            problem = f"make_groups returned a {obs['groups']['shape']}, not (dp_group, tp_group)"
        else:
            got_dp, got_tp = obs["groups"].get("dp"), obs["groups"].get("tp")
            if (got_dp, got_tp) == (want_tp, want_dp) and want_dp != want_tp:
                problem = (f"make_groups returned ranks {got_dp} as the data-parallel group and {got_tp} as the "
                           "tensor-parallel one: the two are swapped, in the order returned (dp_group, tp_group) or "
                           "in how the groups are made (tensor-parallel groups are consecutive ranks)")
            elif got_tp == want_dp and want_dp != want_tp:
                problem = (f"the tensor-parallel group returned is ranks {got_tp}, strided ranks: that is the "
                           "data-parallel group; tensor-parallel groups are consecutive ranks")
            elif got_dp != want_dp or got_tp != want_tp:
                names = []
                for name, got, want in (("data-parallel", got_dp, want_dp), ("tensor-parallel", got_tp, want_tp)):
                    if got != want:
                        shown = f"ranks {got}" if got is not None else \
                            f"a {obs['groups'].get(name[:2] + '_type')} that is no group this rank belongs to"
                        names.append(f"the {name} group returned is {shown}, not {want}")
                problem = "; ".join(names)
            else:
                for name, want in (("dp", want_dp), ("tp", want_tp)):
                    probe = (obs.get("probe") or {}).get(name) or {}
                    if probe.get("error"):
                        problem = f"an all-reduce on the {name} group returned raised {probe['error']}"
                    elif probe.get("joined") != want or any(c not in (0.0, 1.0) for c in probe.get("counts", [])):
                        problem = (f"an all-reduce on the {name} group returned (ranks {want}) summed the one-hot "
                                   f"vectors of ranks {probe.get('joined')}: the group is not wired to its ranks")
                    if problem:
                        break
        if problem:
            g.record("group-members", False, f"rank {rank}: {problem} {layout}", rank=rank, world_size=world_size)
            return False
    g.record("group-members", True)
    return True


# --- the groups of the collectives in train_2d ----------------------------------------------------------


def _no_forward(obs: dict) -> str:
    return ("no forward of a module was seen in train_2d: call the model on the batch (model(x), which runs the "
            "module hooks the grader watches through)")


def check_collective_groups(g: Grader, observations: list[dict], world_size: int, tp_size: int) -> None:
    for rank, obs in enumerate(observations):
        want_dp, want_tp = groups_of(rank, world_size, tp_size)
        for e in obs.get("sequence", []):
            if e.get("kind") != "collective" or e.get("group") is None:
                continue
            step = e.get("after_forwards", 0)
            if e.get("in_forward") and e["group"] != want_tp:
                g.record("collective-groups", False,
                         f"rank {rank}, forward {step}: {_what(e)} ran among {_group_words(e['group'], world_size)}; "
                         f"in forward the MLP sums the partial outputs of one model copy's blocks, among its "
                         f"tensor-parallel group {want_tp}", rank=rank, world_size=world_size)
                return
            if gradient_phase(e) and e["bytes"] > SMALL_MESSAGE and e["group"] != want_dp:
                g.record("collective-groups", False,
                         f"rank {rank}, after forward {step} and before the update: {_what(e)} ran among "
                         f"{_group_words(e['group'], world_size)}; gradients are averaged among the data-parallel "
                         f"group {want_dp}, the ranks that hold the same blocks", rank=rank, world_size=world_size)
                return
    g.record("collective-groups", True)


def check_tp_grads(g: Grader, observations: list[dict], world_size: int, tp_size: int) -> None:
    """No collective of the gradient phase (more than a few numbers) runs among a group holding a
    tensor-parallel peer of the rank."""
    for rank, obs in enumerate(observations):
        _, want_tp = groups_of(rank, world_size, tp_size)
        peers = set(want_tp) - {rank}
        for e in obs.get("sequence", []):
            if not gradient_phase(e) or e.get("group") is None or e["bytes"] <= SMALL_MESSAGE:
                continue
            mixed = sorted(peers & set(e["group"]))
            if mixed:
                g.record("tp-grads-own", False,
                         f"rank {rank}, after forward {e.get('after_forwards')} and before the update: {_what(e)} ran "
                         f"among {_group_words(e['group'], world_size)}, with its tensor-parallel peer(s) {mixed}. "
                         "They hold other blocks of fc1 and fc2 (rows and columns this rank does not have): a gradient "
                         "averaged with theirs mixes different weights", rank=rank, world_size=world_size)
                return
    g.record("tp-grads-own", True)


# --- the batches ------------------------------------------------------------------------------------------


def _steps_or_problem(obs: dict) -> tuple[list[list[dict]] | None, str | None]:
    timeline = obs.get("sequence", [])
    if not training_forwards(timeline):
        return None, _no_forward(obs)
    steps = steps_of(timeline)
    if any(step_batch(s) is None for s in steps):
        return None, "a forward was called with no tensor argument: the grader cannot see its batch"
    return steps, None


def check_tp_batches(g: Grader, observations: list[dict], world_size: int, tp_size: int) -> None:
    for first in range(0, world_size, tp_size):
        members = list(range(first, first + tp_size))
        seen = {}
        for rank in members:
            steps, problem = _steps_or_problem(observations[rank])
            if problem:
                g.record("tp-same-batch", False, f"rank {rank}: {problem}", rank=rank, world_size=world_size)
                return
            seen[rank] = steps
        lead = members[0]
        for rank in members[1:]:
            if len(seen[rank]) != len(seen[lead]):
                g.record("tp-same-batch", False,
                         f"ranks {lead} and {rank} (one tensor-parallel group) trained {len(seen[lead])} and "
                         f"{len(seen[rank])} steps", rank=rank, world_size=world_size)
                return
            for i, (a, b) in enumerate(zip(seen[lead], seen[rank])):
                batch_a, batch_b = step_batch(a), step_batch(b)
                if batch_a.shape != batch_b.shape or not torch.equal(batch_a, batch_b):
                    data = make_data()[0]
                    rows_a, rows_b = row_indices(batch_a, data), row_indices(batch_b, data)
                    g.record("tp-same-batch", False,
                             f"step {i + 1}: rank {lead} fed the model rows {_rows(rows_a)} of data, rank {rank} rows "
                             f"{_rows(rows_b)}; ranks {members} are one tensor-parallel group, computing each layer "
                             "together on one batch: take the shard by dp rank (rank // tp_size), which the peers share",
                             rank=rank, world_size=world_size)
                    return
    g.record("tp-same-batch", True)


def check_dp_shards(g: Grader, observations: list[dict], world_size: int, tp_size: int) -> None:
    data = make_data()[0]
    n = data.shape[0]
    for column in range(tp_size):
        members = list(range(column, world_size, tp_size))
        per_rank = {}
        for rank in members:
            steps, problem = _steps_or_problem(observations[rank])
            if problem:
                g.record("dp-shards", False, f"rank {rank}: {problem}", rank=rank, world_size=world_size)
                return
            per_rank[rank] = steps
        count = min(len(s) for s in per_rank.values())
        for i in range(count):
            counts = [0] * n
            taken = {}
            for rank in members:
                batch = step_batch(per_rank[rank][i])
                indices = row_indices(batch, data)
                if batch.shape[-1] != IN_FEATURES or None in indices:
                    g.record("dp-shards", False,
                             f"rank {rank}, step {i + 1}: the model was fed rows that are not rows of data (a batch "
                             f"of shape {list(batch.shape)}): train on rows of the inputs given", rank=rank,
                             world_size=world_size)
                    return
                taken[rank] = sorted(indices)
                for j in indices:
                    counts[j] += 1
            twice = [j for j, c in enumerate(counts) if c > 1]
            missing = [j for j, c in enumerate(counts) if c == 0]
            if twice or missing:
                shards = "; ".join(f"rank {r}: {_rows(rows)}" for r, rows in taken.items())
                parts = []
                if twice:
                    parts.append(f"rows {_rows(twice)} of data were trained on more than once")
                if missing:
                    parts.append(f"rows {_rows(missing)} by no rank")
                g.record("dp-shards", False,
                         f"step {i + 1}, data-parallel group {members}: {' and '.join(parts)} ({shards}); the ranks "
                         f"of a data-parallel group each take one of {len(members)} disjoint shards of the {n} rows, "
                         "by dp rank", rank=members[0], world_size=world_size)
                return
    g.record("dp-shards", True)


# --- the result -------------------------------------------------------------------------------------------


def check_training_error(g: Grader, observations: list[dict], world_size: int) -> bool:
    found = _first_error(observations, "train_error")
    if found is None:
        return True
    rank, error = found
    if error.get("group_calls"):
        g.not_checked("matches-single", "same-group-calls", "train_2d's groups could not be made", world_size=world_size)
        return False
    g.record("matches-single", False, f"rank {rank}: train_2d raised {_said(error)}", rank=rank, world_size=world_size)
    return False


def _drift(obs: dict, reference: dict, rank: int, tp_size: int) -> str:
    """Where the rank's blocks first left the dense model's, seen at the start of each step."""
    steps = steps_of(obs.get("sequence", []))
    tp_rank = rank % tp_size
    for i, step in enumerate(steps[:len(reference["before"])]):
        params = step[0].get("params") or {}
        for name in PARAMETERS:
            if name not in params:
                continue
            want = local_block(name, reference["before"][i], tp_rank, tp_size)
            found = tensor_difference(params[name], want, rtol=RTOL, atol=ATOL * float(want.abs().max()), name=name)
            if found is not None:
                when = "at the start" if i == 0 else f"after step {i}"
                return f"; its own blocks already differed {when}: {found}"
    return ""


def compare_state(got: dict, want: dict, rank: int, tp_size: int) -> str | None:
    if got.get("kind") != "dict":
        return f"train_2d returned a {got.get('kind')}, not the state dict"
    tensors = got.get("tensors", {})
    missing = [k for k in STATE_KEYS if k not in tensors]
    if missing:
        return (f"the state dict has no {', '.join(missing)} (its keys: {sorted(tensors) + sorted(got.get('other', {}))}); "
                f"the keys are {list(STATE_KEYS)}")
    for key in STATE_KEYS:
        value, expected = tensors[key], want[key]
        if value.shape != expected.shape:
            block = local_block(key.replace(".", "_"), want, rank % tp_size, tp_size)
            hint = ": this rank's block, not the blocks gathered over the tensor-parallel group" \
                if value.shape == block.shape and tp_size > 1 else ""
            return f"{key} has shape {list(value.shape)}, not {list(expected.shape)}{hint}"
        found = tensor_difference(value.double(), expected, rtol=RTOL, atol=ATOL * float(expected.abs().max()), name=key)
        if found is not None:
            return found
    return None


def check_matches_single(g: Grader, observations: list[dict], reference: dict, world_size: int, tp_size: int) -> None:
    for rank, obs in enumerate(observations):
        problem = compare_state(obs.get("returned") or {"kind": "nothing"}, reference["final"], rank, tp_size)
        if problem is not None:
            g.record("matches-single", False,
                     f"world size {world_size} (dp {world_size // tp_size} x tp {tp_size}), rank {rank}: after {STEPS} "
                     f"steps (lr {LR}), against the dense MLP trained in one process on all {make_data()[0].shape[0]} "
                     f"rows: {problem}{_drift(obs, reference, rank, tp_size)}", rank=rank, world_size=world_size)
            return
    g.record("matches-single", True)


# --- bad input ----------------------------------------------------------------------------------------------


def check_bad_input(g: Grader, outcome, cases: list[dict], uneven_reference: dict, world_size: int) -> None:
    """``outcome``: bad_main's run; ``cases``: rank.bad_cases(world_size)."""
    failed = [r for r in outcome.ranks if not r.ok]
    results = [r.result if r.ok else None for r in outcome.ranks]
    for i, case in enumerate(cases):
        for rank, result in enumerate(results):
            if result is None:
                r = failed[0]
                said = (r.error or {}).get("message") or f"ended ({r.status}, exit code {r.exitcode})"
                g.record("bad-input-refused", False,
                         f"world size {world_size}: with bad input, rank {r.rank} did not come back: {said[:300]}",
                         rank=r.rank, world_size=world_size)
                return
            records = result["cases"]
            if i >= len(records):
                continue  # an earlier case already failed on some rank
            record = records[i]
            if record["raised"] == "ValueError":
                continue
            if case["name"] == "uneven_rows" and record["raised"] is None and \
                    compare_state(record["returned"] or {}, uneven_reference["final"], rank,
                                  case["tp_size"]) is None:
                continue  # shards of different sizes, each weighted by its rows: a right result
            if record["raised"]:
                did = f"raised {record['raised']}: {record['message']}"
            elif case["function"] == "make_groups":
                did = "returned groups"
            else:
                did = "returned " + ("a wrong result" if case["name"] == "uneven_rows" else "a result")
            g.record("bad-input-refused", False,
                     f"world size {world_size}, rank {rank}: given {case['what']}, {case['function']} {did}; "
                     "expected a ValueError saying what is wrong, on every rank, before any collective",
                     rank=rank, world_size=world_size)
            return
    g.record("bad-input-refused", True)
