"""Exercise 36's verdicts, from the ranks' records (grader side): the mesh, the placements, the FSDP units, the
group of every collective, what each rank held, training against one process, and the recovery (the state
after it bit for bit, the steps after it against the replay, its messages and their bytes).

A record is what the driver returned for one rank: ``mesh`` and ``params`` (as shard_hybrid left them), ``held``
(bytes and whole tensors found in memory), each step's ``events`` (collectives with their group's global ranks,
a ``forward-returned`` mark) and ``params`` (local values); then ``before`` (the state at the failure, every
rank), ``replay`` (the same steps without the failure), ``wiped``, ``recovery`` (its dispatched messages, files
written, whole tensors found, an error), ``after`` (the state right after recover_from_peer) and ``resumed``
(after the steps that follow). A state is ``{"params": {name: tensor}, "state": {name: {key: tensor}}}``."""

from __future__ import annotations

import torch

from grader.rank import probes
from grader.checks.ex36_hybrid_recovery.reference import held_limit, local_shape
from grader.checks.interface import Grader
from grader.checks.shared.learner_errors import checked_record, stop_on_learner_error
from grader.compare import tensor_difference

ALL_GATHERS, REDUCE_SCATTERS = probes.ALL_GATHERS, probes.REDUCE_SCATTERS
# Of the largest change of a parameter. float64: sums in another order. float32: AdamW divides each gradient by
# its own size, so float32's rounding of a small gradient moves its update by up to a few tenths of a percent
# (0.12 % measured at 2 ranks; a replica that never averages with the others is off by 100 % and more).
TOLERANCE = {"float64": 1e-9, "float32": 1e-2}
HELD_SLACK = 1024  # bytes a rank may hold beyond its shards (FSDP2's own small tensors)
SMALL_MESSAGE = 64  # bytes: a message this small carries a flag or a number, no state
HEADER_BYTES = 1024  # what recovery may send besides the state's tensors (a step number, a length)
RECOVERY_CHECKS = ("recovered-bitwise", "training-resumes", "peer-messages", "recovery-bytes")


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(repr(n) for n in names[:shown]) + (", ..." if len(names) > shown else "")


def replica_ranks(plan: dict, replica: int) -> list[int]:
    return [replica * plan["shards"] + s for s in range(plan["shards"])]


def shard_ranks(plan: dict, shard: int) -> list[int]:
    return [r * plan["shards"] + shard for r in range(plan["replicas"])]


def _kib(n: int) -> str:
    return f"{n} byte{'' if n == 1 else 's'}" if n < 10_240 else f"{n / 1024:.1f} KiB"


# --- the records as sent ----------------------------------------------------------------------------


def _tensors(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())


def _state(value) -> bool:
    return isinstance(value, dict) and _tensors(value.get("params")) and isinstance(value.get("state"), dict) and \
        all(isinstance(k, str) and _tensors(v) for k, v in value["state"].items())


def _event(value) -> bool:
    group = value.get("group") if isinstance(value, dict) else None
    return isinstance(value, dict) and isinstance(value.get("op"), str) and type(value.get("bytes", 0)) is int and \
        (group is None or (isinstance(group, list) and all(type(r) is int for r in group))) and \
        (value.get("peer") is None or type(value.get("peer")) is int)


def _held(value) -> bool:
    return isinstance(value, dict) and isinstance(value.get("when"), str) and type(value.get("bytes")) is int and \
        isinstance(value.get("whole"), list) and all(isinstance(n, str) for n in value["whole"])


def readable(obs) -> bool:
    """Whether a rank's record has the types the verdicts read (a learner's code shares the rank's process)."""
    if not isinstance(obs, dict) or not isinstance(obs.get("params", {}), dict):
        return False
    if not all(isinstance(v, dict) for v in obs.get("params", {}).values()):
        return False
    steps = obs.get("steps", [])
    if not isinstance(steps, list) or not all(isinstance(s, dict) and isinstance(s.get("events"), list) and
                                              all(_event(e) for e in s["events"]) and _tensors(s.get("params"))
                                              for s in steps):
        return False
    if any(obs.get(key) is not None and not _state(obs[key]) for key in ("before", "replay", "after", "resumed")):
        return False
    recovery = obs.get("recovery")
    if recovery is not None and not (isinstance(recovery, dict) and isinstance(recovery.get("events"), list) and
                                     all(_event(e) for e in recovery["events"]) and
                                     isinstance(recovery.get("collectives", []), list) and
                                     all(_event(e) for e in recovery.get("collectives", [])) and
                                     all(isinstance(w, str) for w in recovery.get("writes", [])) and
                                     all(isinstance(w, str) for w in recovery.get("saves", [])) and
                                     all(_held(h) for h in recovery.get("held", []))):
        return False
    return isinstance(obs.get("held", []), list) and all(_held(h) for h in obs.get("held", []))


# --- what shard_hybrid built ---------------------------------------------------------------------


def check_mesh(g: Grader, observations: list[dict], world_size: int, plan: dict, device_type: str) -> None:
    want_layout = [replica_ranks(plan, r) for r in range(plan["replicas"])]
    want = f"shape {[plan['replicas'], plan['shards']]} named ['replicate', 'shard'] with rows {want_layout}"
    for rank, obs in enumerate(observations):
        mesh = obs.get("mesh") or {}
        if mesh.get("type") != "DeviceMesh":
            g.record("mesh", False, f"rank {rank}: shard_hybrid returned a {mesh.get('type')} as the mesh, not a "
                     "DeviceMesh", rank=rank, world_size=world_size)
            return
        seen = f"shape {mesh.get('shape')} named {mesh.get('names')} with rows {mesh.get('layout')}"
        if mesh.get("names") != ["replicate", "shard"] or mesh.get("shape") != [plan["replicas"], plan["shards"]]:
            g.record("mesh", False, f"rank {rank}: the mesh has {seen}; with replicas={plan['replicas']} and "
                     f"shards={plan['shards']} it must have {want}", rank=rank, world_size=world_size)
            return
        if mesh.get("layout") != want_layout:
            g.record("mesh", False, f"rank {rank}: the mesh has {seen}: a replica must be a row of neighbouring "
                     f"ranks ({want_layout}), \"shard\" the inner dimension", rank=rank, world_size=world_size)
            return
        if mesh.get("device_type") != device_type:
            g.record("mesh", False, f"rank {rank}: the mesh is on {mesh.get('device_type')!r}, the model's parameters "
                     f"on {device_type!r}", rank=rank, world_size=world_size)
            return
    g.record("mesh", True)


def check_placements(g: Grader, observations: list[dict], world_size: int, plan: dict,
                     shapes: dict[str, list[int]]) -> None:
    shards = plan["shards"]
    for rank, obs in enumerate(observations):
        params = obs.get("params") or {}
        missing = [n for n in shapes if n not in params]
        if missing:
            g.record("hybrid-placements", False, f"rank {rank}: the model shard_hybrid returned has no parameter "
                     f"{_some(missing)}", rank=rank, world_size=world_size)
            return
        for name, shape in shapes.items():
            entry = params[name]
            if not entry.get("dtensor"):
                g.record("hybrid-placements", False,
                         f"rank {rank}: {name!r} is a plain tensor, whole on every rank: no fully_shard call took it "
                         "(call it on each block, then on the model)", rank=rank, world_size=world_size)
                return
            placements, mesh_shape = entry.get("placements"), entry.get("mesh_shape")
            if placements != ["Replicate()", "Shard(dim=0)"] or mesh_shape != [plan["replicas"], shards]:
                g.record("hybrid-placements", False,
                         f"rank {rank}: {name!r} is placed ({', '.join(map(str, placements or []))}) on a mesh of "
                         f"shape {mesh_shape}; hybrid sharding places it (Replicate(), Shard(dim=0)) on the 2-D mesh "
                         f"({plan['replicas']}, {shards}): the same shards in every replica, dim 0 split over the "
                         "replica's ranks", rank=rank, world_size=world_size)
                return
            want = local_shape(shape, shards, rank % shards)
            if entry.get("local_shape") != want:
                g.record("hybrid-placements", False,
                         f"rank {rank}: {name!r} (shape {shape}) holds a local shard of shape "
                         f"{entry.get('local_shape')}; shard {rank % shards} of {shards} is rows of shape {want}",
                         rank=rank, world_size=world_size)
                return
    g.record("hybrid-placements", True)


def forward_events(events: list[dict]) -> list[dict]:
    marks = [i for i, e in enumerate(events) if e.get("op") == "mark"]
    return events[:marks[0]] if marks else events


def check_units(g: Grader, observations: list[dict], world_size: int, plan: dict, units: dict,
                itemsize: int) -> None:
    """``units``: reference.unit_elements(shards)."""
    blocks, root = units["blocks"], units["root"]
    for rank, obs in enumerate(observations):
        for step, record in enumerate(obs.get("steps", [])):
            gathered = sorted(e["bytes"] // itemsize for e in forward_events(record["events"])
                              if e.get("op") in ALL_GATHERS)
            if gathered != sorted(blocks + [root]):
                whole = sum(blocks) + root
                if whole in gathered:
                    seen = f"one all-gather of {whole} elements, every parameter of the replica: only the root was " \
                           "given to fully_shard, so the whole model is one unit"
                else:
                    seen = f"{len(gathered)} all-gather(s) of {gathered} elements"
                g.record("block-units", False,
                         f"step {step + 1}, rank {rank}: the forward pass made {seen}; expected one all-gather of each "
                         f"of the {len(blocks)} blocks ({', '.join(map(str, blocks))} elements sent by each rank) and "
                         f"one of the root's own parameters, {', '.join(units['root_names'])} ({root})",
                         rank=rank, world_size=world_size)
                return
    g.record("block-units", True)


def check_groups(g: Grader, observations: list[dict], world_size: int, plan: dict) -> None:
    """Gathers and reduce-scatters inside the rank's replica, all-reduces among its shard's ranks."""
    shards, replicas = plan["shards"], plan["replicas"]
    for rank, obs in enumerate(observations):
        row, column = replica_ranks(plan, rank // shards), shard_ranks(plan, rank % shards)
        for step, record in enumerate(obs.get("steps", [])):
            where = f"step {step + 1}, rank {rank}"
            events = [e for e in record["events"] if e.get("op") != "mark"]
            for e in events:
                op, group = e.get("op"), e.get("group")
                want = row if op in ALL_GATHERS + REDUCE_SCATTERS else column if op == "all_reduce" else None
                if want is None or group != want:
                    kind = ("an all-gather of parameters or a reduce-scatter of gradients belongs to the replica's "
                            f"ranks {row}" if op in ALL_GATHERS + REDUCE_SCATTERS else
                            f"the all-reduce of gradients across replicas belongs to the ranks holding shard "
                            f"{rank % shards}, {column}" if op == "all_reduce" else "a training step makes no "
                            "other collective")
                    g.record("collective-groups", False,
                             f"{where}: {op} of {_kib(e.get('bytes', 0))} ran among ranks {group}: {kind}",
                             rank=rank, world_size=world_size)
                    return
            if shards > 1 and not any(e["op"] in REDUCE_SCATTERS for e in events):
                g.record("collective-groups", False, f"{where}: no reduce-scatter: the gradients were not reduced "
                         f"inside the replica {row}", rank=rank, world_size=world_size)
                return
            if replicas > 1 and not any(e["op"] == "all_reduce" for e in events):
                g.record("collective-groups", False,
                         f"{where}: no all-reduce across the replicas: each replica trained on its own batches alone "
                         f"(fully_shard must be given the 2-D mesh, whose dim 0 makes the all-reduce among {column})",
                         rank=rank, world_size=world_size)
                return
    g.record("collective-groups", True)


def check_held(g: Grader, observations: list[dict], world_size: int, plan: dict, itemsize: int) -> None:
    limits = {"after shard_hybrid": held_limit(plan["shards"], itemsize, False)}
    with_state = held_limit(plan["shards"], itemsize, True)
    for rank, obs in enumerate(observations):
        for entry in list(obs.get("held", [])) + list((obs.get("recovery") or {}).get("held", [])):
            when = entry.get("when", "?")
            if entry.get("whole"):
                g.record("holds-one-over-shards", False,
                         f"rank {rank}, {when}: held {_some(entry['whole'])} whole (found byte for byte in its "
                         f"memory); each rank holds its 1/{plan['shards']} of every parameter and optimizer state, "
                         "and a recovery moves shards, never whole tensors", rank=rank, world_size=world_size)
                return
            limit = limits.get(when, with_state)
            if entry.get("bytes", 0) > limit + HELD_SLACK:
                g.record("holds-one-over-shards", False,
                         f"rank {rank}, {when}: the model, the optimizer and your module's globals hold "
                         f"{_kib(entry['bytes'])} of tensors; 1/{plan['shards']} of the model"
                         f"{' and its AdamW state' if when in limits else ''} is {_kib(limit)}: a copy of the model "
                         "or of its state is kept besides the shards", rank=rank, world_size=world_size)
                return
    g.record("holds-one-over-shards", True)


def check_training(g: Grader, observations: list[dict], world_size: int, plan: dict, reference: dict) -> None:
    shards, tolerance = plan["shards"], TOLERANCE[plan["dtype"]]
    for rank, obs in enumerate(observations):
        records = [(step, record["params"]) for step, record in enumerate(obs.get("steps", []))]
        if obs.get("replay"):
            records.append((len(reference["states"]) - 1, obs["replay"]["params"]))
        for step, params in records:
            for name, full in reference["states"][step].items():
                initial = reference["initial"][name]
                want = torch.chunk(full, shards, dim=0)[rank % shards] if full.dim() else full
                got = params.get(name)
                if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
                    g.record("matches-single-process", False, f"after step {step + 1}, rank {rank}: {name!r} holds "
                             f"{'nothing' if got is None else list(got.shape)}, expected {list(want.shape)}",
                             rank=rank, world_size=world_size)
                    return
                scale = float((full - initial).abs().max())
                found = tensor_difference(got.double(), want, atol=tolerance * scale + 1e-12)
                if found is not None:
                    g.record("matches-single-process", False,
                             f"after step {step + 1}, rank {rank}: {name!r} differs from one process training on every "
                             f"rank's batch ({world_size} x 4 rows) with AdamW by up to {found.max_abs:.3g}, "
                             f"{found.max_abs / max(scale, 1e-300):.0%} of the largest change of that parameter: the "
                             "gradients are averaged over every rank of every replica",
                             rank=rank, world_size=world_size)
                    return
    g.record("matches-single-process", True)


# --- the recovery ----------------------------------------------------------------------------------


def recovery_failed(g: Grader, observations: list[dict], world_size: int) -> None:
    """Stop the grading with the first exception recover_from_peer raised (the cause, not a peer left waiting)."""
    failed = [(rank, o["recovery"].get("error_record")) for rank, o in enumerate(observations)
              if (o.get("recovery") or {}).get("error")]
    if not failed:
        return
    failed.sort(key=lambda item: any(w in str((checked_record(item[1]) or {}).get("message", "")).lower()
                                     for w in ("by peer", "timed out", "timeout", "connection reset")))
    stop_on_learner_error(g, world_size, failed, "recover_from_peer")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(got, want: torch.Tensor, what: str) -> str | None:
    """None when ``got`` is ``want`` bit for bit, else what differs, in words."""
    if not isinstance(got, torch.Tensor):
        return f"{what} is missing" if got is None else f"{what} is a {type(got).__name__}"
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{what} is {str(got.dtype).removeprefix('torch.')} {list(got.shape)}, not " \
               f"{str(want.dtype).removeprefix('torch.')} {list(want.shape)}"
    if torch.equal(_bits(got), _bits(want)):
        return None
    if want.dim() == 0:
        return f"{what} is {float(got):g}, not {float(want):g}"
    found = tensor_difference(got, want)
    where = f" at {list(found.index)}" if found and found.index else ""
    if found is None:  # equal values, other bits: 0.0 and -0.0
        return f"{what} differs in its bits (0.0 against -0.0)"
    return f"{what} differs by up to {found.max_abs:.3g}{where}"


def _compare_states(got: dict, want: dict) -> str | None:
    """Where ``got`` differs from ``want`` bit for bit (parameters, then each one's optimizer state), or None."""
    for name, value in want["params"].items():
        found = _same(got["params"].get(name), value, repr(name))
        if found:
            return found
    for name, entry in want["state"].items():
        mine = got["state"].get(name) or {}
        for key, value in entry.items():
            found = _same(mine.get(key), value, f"the optimizer's {key} of {name!r}")
            if found:
                return found
    return None


def check_recovered(g: Grader, observations: list[dict], world_size: int, plan: dict) -> None:
    shards, source = plan["shards"], plan["source"]
    for rank, obs in enumerate(observations):
        peer = source * shards + rank % shards
        want = observations[peer].get("before")
        where = f"rank {rank}" + (f" (wiped; shard {rank % shards} of replica {source} is rank {peer})"
                                  if obs.get("wiped") else f" (replica {rank // shards}, not wiped)")
        difference = _compare_states(obs["after"], want)
        if difference is not None:
            g.record("recovered-bitwise", False,
                     f"{where}: after recover_from_peer {difference}, where rank {peer} held it before the recovery: "
                     + ("every parameter shard and every AdamW state tensor (exp_avg, exp_avg_sq, step) comes from "
                        "the same shard of the source replica" if obs.get("wiped") else
                        "a replica that was not wiped must keep its own state (the source sends, it never receives)"),
                     rank=rank, world_size=world_size)
            return
    g.record("recovered-bitwise", True)


def left_wrong(observations: list[dict], plan: dict) -> tuple[int, str] | None:
    """(rank, what differs) for the first rank the recovery left with a state other than its source's (as
    check_recovered compares them: every replica against the source's state at the failure)."""
    for rank, obs in enumerate(observations):
        peer = plan["source"] * plan["shards"] + rank % plan["shards"]
        difference = _compare_states(obs["after"], observations[peer]["before"])
        if difference is not None:
            return rank, difference
    return None


def check_resumed(g: Grader, observations: list[dict], world_size: int, plan: dict) -> None:
    left = left_wrong(observations, plan)
    for rank, obs in enumerate(observations):
        if obs.get("error"):
            g.record("training-resumes", False, f"rank {rank}: the training step after recover_from_peer raised "
                     f"{obs['error']}", rank=rank, world_size=world_size)
            return
        difference = _compare_states(obs["resumed"], obs["replay"])
        if difference is None:
            continue
        if left is not None:  # the steps start from a state the recovery did not restore
            wrong, what = left
            cause = (f"the recovery left rank {wrong} with a state other than its source's ({what}; "
                     "recovered-bitwise): AdamW's next update reads exp_avg, exp_avg_sq and the step count (its bias "
                     "correction), so every one of them must come back before training goes on")
        else:
            cause = ("the recovery left every rank the source's state, so the steps did not train the tensors it "
                     "filled: the optimizer and FSDP must keep the parameters and state tensors they hold (receive "
                     "into the parameters' own shards, in place)")
        g.record("training-resumes", False,
                 f"rank {rank}{' (wiped)' if obs.get('wiped') else ''}: after the steps that follow the recovery "
                 f"{difference} from the same steps of the job without the failure: {cause}",
                 rank=rank, world_size=world_size)
        return
    g.record("training-resumes", True)


def _is_point_to_point(op: str) -> bool:
    return "c10d.send" in op or "c10d.recv_" in op


def _file_written(observations: list[dict]) -> tuple[int, str] | None:
    """(rank, what) for the first file a recovery wrote: torch.save to a path (written from C++, seen apart), or a
    file opened for writing (a torch.save on any rank before an open on any)."""
    for rank, obs in enumerate(observations):  # torch.save on any rank names the cause better than an open
        if obs["recovery"].get("saves"):
            return rank, f"torch.save wrote {obs['recovery']['saves'][0]!r}"
    for rank, obs in enumerate(observations):
        if obs["recovery"].get("writes"):
            return rank, f"opened {obs['recovery']['writes'][0]!r} for writing"
    return None


def _collective_words(op: str) -> str:
    if "barrier" in op:
        return ("a barrier is a collective: every rank of its group stops until all have reached it, the very stop "
                "of every replica a recovery from a peer avoids")
    if "gather" in op:
        return "a gather brings whole tensors onto each rank of the group"
    return ("a collective makes every rank of its group take part (with more replicas, each healthy one receives "
            "what it already holds)")


def check_messages(g: Grader, observations: list[dict], world_size: int, plan: dict) -> bool:
    shards, source = plan["shards"], plan["source"]
    written = _file_written(observations)
    if written is not None:
        rank, what = written
        return g.record("peer-messages", False, f"rank {rank}: recover_from_peer {what}: a recovery from a live peer "
                        "sends the state in messages, no file", rank=rank, world_size=world_size)
    for rank, obs in enumerate(observations):
        fail = lambda message: g.record("peer-messages", False, message, rank=rank, world_size=world_size)  # noqa
        recovery = obs["recovery"]
        is_source = rank // shards == source
        peers = [r * shards + rank % shards for r in plan["wiped"]] if is_source else [source * shards + rank % shards]
        received = 0
        # Every c10d operation dispatched, then the Python API's collectives (one a DTensor operation runs
        # inside its own dispatch is seen there only).
        for e in recovery.get("events", []) + recovery.get("collectives", []):
            op, size = str(e.get("op")), int(e.get("bytes") or 0)
            if not _is_point_to_point(op):  # whatever its size: the statement allows no collective
                name = op.split(".")[1] if "." in op else op
                return fail(f"rank {rank}: recover_from_peer ran {name} of {_kib(size)} among ranks "
                            f"{e.get('group')}: {_collective_words(op)}; send each local shard point to point, and "
                            "nothing else")
            sends = "c10d.send" in op
            if e.get("peer") not in peers:
                return fail(f"rank {rank}: recover_from_peer {'sent' if sends else 'received'} {_kib(size)} "
                            f"{'to' if sends else 'from'} rank {e.get('peer')}; rank {rank} (shard {rank % shards} of "
                            f"replica {rank // shards}) exchanges only with rank{'s' if len(peers) > 1 else ''} "
                            f"{', '.join(map(str, peers))}, the same shard of "
                            f"{'the wiped replica' if is_source else f'the source replica {source}'}")
            if sends and not is_source and size > SMALL_MESSAGE:
                return fail(f"rank {rank} (wiped) sent {_kib(size)} to rank {e.get('peer')} of the source replica: the "
                            "state travels from the source replica to the wiped one")
            received += 0 if sends else size
        if not is_source and received <= SMALL_MESSAGE:
            return fail(f"rank {rank} (wiped) received {_kib(received)} from its peer rank {peers[0]} during "
                        "recover_from_peer")
    return g.record("peer-messages", True)


def state_bytes(state: dict) -> int:
    """The bytes of a rank's local state: its parameters' shards and every optimizer state tensor."""
    total = sum(t.numel() * t.element_size() for t in state["params"].values())
    return total + sum(t.numel() * t.element_size() for entry in state["state"].values() for t in entry.values())


def step_bytes(state: dict) -> int:
    """The bytes of a rank's step counts, one per parameter (AdamW steps every parameter together: one number
    carries them all)."""
    return sum(t.numel() * t.element_size() for entry in state["state"].values() for key, t in entry.items()
               if key == "step")


def check_bytes(g: Grader, observations: list[dict], world_size: int, plan: dict) -> list[str]:
    """Also returns a line per source rank for the report's section."""
    shards, source = plan["shards"], plan["source"]
    lines = []
    for shard in range(shards):
        rank = source * shards + shard
        expected = state_bytes(observations[rank]["before"])
        steps = step_bytes(observations[rank]["before"])
        for replica in plan["wiped"]:
            peer = replica * shards + shard
            sent = sum(int(e.get("bytes") or 0) for e in observations[rank]["recovery"].get("events", [])
                       if "c10d.send" in str(e.get("op")) and e.get("peer") == peer)
            lines.append(f"rank {rank} -> rank {peer}: {sent} bytes sent, its local state {expected} bytes")
            # Every step count, or one number for them all (a few bytes, within the header's allowance).
            if not expected - steps < sent <= expected + HEADER_BYTES:
                if steps and sent == expected - steps:
                    seen = "its parameter shards and AdamW's moments, and no step count: send each parameter's " \
                           "step, or one step number for all (AdamW steps them together)"
                elif sent < expected - steps:
                    seen = "less than its state: some tensors were not sent (every parameter shard, exp_avg and " \
                           "exp_avg_sq, and the step count)"
                elif sent >= 2 * expected - HEADER_BYTES:
                    seen = f"{sent / expected:.2g} times its state: whole tensors, a wider dtype or a copy sent twice"
                else:
                    seen = f"{sent - expected} bytes more than its state (at most {HEADER_BYTES} are allowed besides " \
                           "the tensors: send each local tensor as it is, no pickled description)"
                g.record("recovery-bytes", False,
                         f"rank {rank} sent rank {peer} {sent} bytes; its local state (the shards of every parameter "
                         f"and of AdamW's state, and the step counts, {steps} bytes of it) is {expected} bytes: {seen}",
                         rank=rank, world_size=world_size)
                return lines
    g.record("recovery-bytes", True)
    return lines
