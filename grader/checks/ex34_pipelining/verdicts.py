"""Exercise 34's verdicts, from the ranks' records of one schedule (pure: the unit tests
feed them hand-made records).

``per_rank[r]`` is what rank r recorded for one schedule: ``held`` (the model's parameters whose
values the rank holds after build_pipeline), ``stages`` (each PipelineStage built: index,
num_stages, the parameters its module holds), ``build_events``, ``initial`` (the returned modules'
parameters, "i/name"), ``steps`` (per step: ``events``, ``actions`` [("F" or "B", stage, micro-batch)],
``peak_live``, ``loss``, ``params``) and ``error``."""

from __future__ import annotations

from collections import Counter

import torch

from grader.rank.drivers import ex34_pipelining as rank_side
from grader.checks.interface import Grader
from grader.compare import first_difference

HEADER_LIMIT = 256  # bytes: a message this small is PipelineStage's shape exchange (or a loss), not an activation
SEND_OPS = ("send", "isend")
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
RTOL, ATOL = 1e-9, 1e-12  # float64; the stages add the micro-batches' gradients in the same order as one process
LOSS_RTOL = 1e-9
TRAINING_CHECKS = ("neighbours-only", "messages-per-step", "named-schedule", "grad-scale", "loss-returned")


def describe(schedule: str, world_size: int) -> str:
    return (f"schedule {schedule!r}, world size {world_size}, {rank_side.n_microbatches(world_size)} micro-batches, "
            f"{rank_side.stages_per_rank(schedule) * world_size} stages")


def expected_names(schedule: str, stages: list[int], world_size: int) -> set[str]:
    num_stages = rank_side.stages_per_rank(schedule) * world_size
    names = [n for n, _ in rank_side.build_model(schedule, world_size).named_parameters()]
    return {n for n in names if rank_side.stage_of(n, num_stages, world_size) in stages}


def _layers(names) -> str:
    """Parameter names, shortened to their modules: layers.3, tok_embeddings, output."""
    mods = sorted({".".join(n.split(".")[:2]) if n.startswith("layers.") else n.split(".")[0] for n in names},
                  key=lambda m: (m != "tok_embeddings", m == "output", int(m.split(".")[1]) if "." in m else 0))
    return ", ".join(mods)


def not_run(g: Grader, schedule: str, world_size: int) -> None:
    for check_id in ("own-layers", "stage-assignment", "matches-single-process") + TRAINING_CHECKS:
        g.not_checked(check_id, "matches-single-process", f"{describe(schedule, world_size)}: not run, as an "
                      "earlier schedule failed", world_size=world_size)


def check_schedule(g: Grader, schedule: str, per_rank: list[dict], world_size: int, reference: dict) -> None:
    returned = next((obs["returned"] for obs in per_rank if obs.get("returned")), None)
    if returned is not None:
        g.stop(f"{describe(schedule, world_size)}: build_pipeline returned {returned}: return (schedule, "
               "stage_modules), the schedule object and the list of the modules this rank's stages run",
               world_size=world_size)
    check_own_layers(g, schedule, per_rank, world_size)
    check_assignment(g, schedule, per_rank, world_size, reference)
    if not check_no_error(g, schedule, per_rank, world_size):
        return
    check_neighbours(g, schedule, per_rank, world_size)
    check_messages(g, schedule, per_rank, world_size)
    check_named(g, schedule, per_rank, world_size)
    names = [matched_names(obs["initial"], reference["initial"]) for obs in per_rank]
    check_grad_scale(g, schedule, per_rank, world_size, reference, names)
    check_training(g, schedule, per_rank, world_size, reference, names)
    check_loss(g, schedule, per_rank, world_size, reference)


# --- what each rank holds -------------------------------------------------------------------------


def check_own_layers(g: Grader, schedule: str, per_rank: list[dict], world_size: int) -> None:
    for rank, obs in enumerate(per_rank):
        mine = expected_names(schedule, rank_side.stages_of_rank(schedule, rank, world_size), world_size)
        extra = sorted(set(obs["held"]) - mine)
        if extra:
            g.record("own-layers", False,
                     f"{describe(schedule, world_size)}: after build_pipeline rank {rank} still holds the values of "
                     f"{len(extra)} parameter(s) of layers its stages "
                     f"{rank_side.stages_of_rank(schedule, rank, world_size)} do not run ({_layers(extra)}), reachable "
                     "from the schedule, the stage modules or your module's globals; a rank keeps only its "
                     "stages' layers", rank=rank, world_size=world_size)
            return
    g.record("own-layers", True)


def check_assignment(g: Grader, schedule: str, per_rank: list[dict], world_size: int, reference: dict) -> None:
    num_stages = rank_side.stages_per_rank(schedule) * world_size
    layout = ("one stage per rank, rank r holding stage r" if rank_side.stages_per_rank(schedule) == 1 else
              f"two stages per rank, looped: rank r holds stages r and r + {world_size}")
    for rank, obs in enumerate(per_rank):
        want = rank_side.stages_of_rank(schedule, rank, world_size)
        built = sorted((s["index"], s["num_stages"]) for s in obs["stages"])
        problem = None
        if [i for i, _ in built] != want or any(n != num_stages for _, n in built):
            shown = ", ".join(f"stage_index {i} of num_stages {n}" for i, n in built) or "no PipelineStage"
            problem = (f"rank {rank} built {shown}; {schedule} on {world_size} ranks has {num_stages} stages, "
                       f"{layout}: rank {rank} holds stage(s) {want} of {num_stages}")
        unknown = [k for k in obs["initial"] if not _matches_any(obs["initial"][k], reference["initial"])]
        if problem is None and unknown:
            problem = (f"rank {rank}'s stage modules hold {len(unknown)} parameter(s) that are none of the "
                       f"model's ({unknown[0]}): take the layers from the model you are given, or copy them")
        for stage in obs["stages"] if problem is None else []:
            should = expected_names(schedule, [stage["index"]], world_size)
            holds = set(stage["holds"])
            if holds != should:
                missing, extra = sorted(should - holds), sorted(holds - should)
                problem = (f"on rank {rank}, stage {stage['index']}'s module holds {_layers(holds) or 'nothing'} "
                           f"of the model; stage {stage['index']} of {num_stages} is {_layers(should)}"
                           + (f" (it lacks {_layers(missing)})" if missing else "")
                           + (f" (with {_layers(extra)}, which other stages run)" if extra else "")
                           + f": {rank_side.n_layers(world_size) // num_stages} consecutive block(s) per stage, the "
                           "embeddings in the first stage and the output head in the last")
                break
        if problem:
            g.record("stage-assignment", False, f"{describe(schedule, world_size)}: {problem}", rank=rank,
                     world_size=world_size)
            return
    g.record("stage-assignment", True)


def _matches_any(value: torch.Tensor, initial: dict) -> bool:
    return any(value.shape == t.shape and torch.equal(value, t) for t in initial.values())


def matched_names(values: dict, initial: dict) -> dict[str, str]:
    """The model's name of each of a rank's parameters ("i/name"), found by its initial values."""
    out = {}
    for key, value in values.items():
        name = next((n for n, t in initial.items() if t.shape == value.shape and torch.equal(t, value)), None)
        if name is not None:
            out[key] = name
    return out


# --- training ---------------------------------------------------------------------------------------


def check_no_error(g: Grader, schedule: str, per_rank: list[dict], world_size: int) -> bool:
    """Record the first rank's exception (the cause, not a peer left waiting); True when none."""
    failed = [(rank, o) for rank, o in enumerate(per_rank) if o.get("error")]
    if not failed:
        return True
    failed.sort(key=lambda item: any(w in item[1]["error"].lower()
                                     for w in ("by peer", "timed out", "timeout", "connection closed")))
    rank, obs = failed[0]
    message = (f"{describe(schedule, world_size)}: rank {rank}: at step {len(obs['steps']) + 1}, train_step raised "
               f"{obs['error']}")
    idle = [r for r, o in enumerate(per_rank) if not o.get("error") and any(not s["actions"] for s in o["steps"])]
    if idle:
        message += (f"; rank(s) {idle} returned from train_step without running their stages (no forward, no "
                    "backward): every rank calls schedule.step, the ranks between the first and the last too")
    g.record("matches-single-process", False, message, rank=rank, world_size=world_size)
    for check_id in TRAINING_CHECKS:
        g.not_checked(check_id, "matches-single-process", "train_step raised before every step was done",
                      world_size=world_size)
    return False


def check_neighbours(g: Grader, schedule: str, per_rank: list[dict], world_size: int) -> None:
    looped = rank_side.stages_per_rank(schedule) > 1
    for rank, obs in enumerate(per_rank):
        if looped:
            neighbours = {(rank - 1) % world_size, (rank + 1) % world_size} - {rank}
        else:
            neighbours = {r for r in (rank - 1, rank + 1) if 0 <= r < world_size}
        events = obs["build_events"] + [e for step in obs["steps"] for e in step["events"]]
        for e in events:
            if e["op"] in POINT_TO_POINT and e["peer"] is not None and e["peer"] not in neighbours:
                direction = "sent to" if e["op"] in SEND_OPS else "received from"
                g.record("neighbours-only", False,
                         f"{describe(schedule, world_size)}: rank {rank} {direction} rank {e['peer']} "
                         f"(dist.{e['op']}, {e['bytes']} bytes); the stages rank {rank} holds exchange activations "
                         f"and their gradients with ranks {sorted(neighbours)} only", rank=rank, world_size=world_size)
                return
    g.record("neighbours-only", True)


def expected_sends(schedule: str, world_size: int) -> list[Counter]:
    """Per rank, the large messages one step sends: Counter of (peer, bytes)."""
    num_stages = rank_side.stages_per_rank(schedule) * world_size
    m, size = rank_side.n_microbatches(world_size), rank_side.activation_bytes()
    out = [Counter() for _ in range(world_size)]
    for b in range(num_stages - 1):
        src, dst = b % world_size, (b + 1) % world_size
        out[src][(dst, size)] += m  # the activations of stage b, forward
        out[dst][(src, size)] += m  # their gradients, backward
    return out


def _sizes(counts: Counter) -> str:
    return ", ".join(f"{n} x {b} bytes to rank {p}" for (p, b), n in sorted(counts.items())) or "nothing"


def check_messages(g: Grader, schedule: str, per_rank: list[dict], world_size: int) -> None:
    want = expected_sends(schedule, world_size)
    for rank, obs in enumerate(per_rank):
        for step, record in enumerate(obs["steps"]):
            got = Counter((e["peer"], e["bytes"]) for e in record["events"]
                          if e["op"] in SEND_OPS and e["bytes"] > HEADER_LIMIT)
            if got != want[rank]:
                g.record("messages-per-step", False,
                         f"{describe(schedule, world_size)}: at step {step + 1} rank {rank} sent {_sizes(got)}; "
                         f"one step sends {_sizes(want[rank])}: each micro-batch's activation of {rank_side.ROWS} x "
                         f"{rank_side.SEQ} x {rank_side.PIPE_DIM} float64 ({rank_side.activation_bytes()} bytes) once to the next stage, and "
                         "its gradient once back", rank=rank, world_size=world_size)
                return
    g.record("messages-per-step", True)


# --- the schedule -----------------------------------------------------------------------------------


def labels(step: dict) -> list[str]:
    return [f"{op}{stage}.{mb}" for op, stage, mb in step["actions"]]


def _sequence(step: dict, limit: int = 32) -> str:
    shown = labels(step)
    return " ".join(shown[:limit]) + (" ..." if len(shown) > limit else "") if shown else "nothing"


def schedule_problem(schedule: str, rank: int, step: dict, world_size: int) -> str | None:
    """What in this rank's step is not the named schedule (None: it is)."""
    m = rank_side.n_microbatches(world_size)
    actions = step["actions"]
    want = rank_side.stages_of_rank(schedule, rank, world_size)
    ran = sorted({s for _, s, _ in actions})
    if ran != want:
        return f"rank {rank} ran stage(s) {ran}, not {want}"
    for s in ran:
        for op, name in (("F", "forward"), ("B", "backward")):
            mbs = sorted(mb for o, stage, mb in actions if o == op and stage == s)
            if mbs != list(range(m)):
                return (f"stage {s} ran {len(mbs)} micro-batch {name}(s) ({mbs}); a step of {m} micro-batches "
                        f"runs each once")
    first_backward = next(i for i, a in enumerate(actions) if a[0] == "B")
    forwards_first = sum(1 for a in actions[:first_backward] if a[0] == "F")
    if schedule == "GPipe" and forwards_first != m:
        return (f"rank {rank} ran {forwards_first} forward(s) before its first backward; GPipe runs all {m} "
                "forwards, then the backwards")
    if schedule == "1F1B" and (forwards_first > world_size or step["peak_live"] > world_size):
        return (f"rank {rank} ran {forwards_first} forwards before its first backward and held the activations "
                f"of {step['peak_live']} micro-batches at once; 1F1B starts backward after at most W = {world_size} "
                f"forwards, and holds at most W")
    if schedule == "Interleaved1F1B":
        early, late = want
        last_early = max(i for i, a in enumerate(actions) if a[0] == "F" and a[1] == early)
        first_late = min(i for i, a in enumerate(actions) if a[0] == "F" and a[1] == late)
        last_forward = max(i for i, a in enumerate(actions) if a[0] == "F")
        if first_late > last_early or first_backward > last_forward or step["peak_live"] >= 2 * m:
            return (f"rank {rank} held the activations of {step['peak_live']} (stage, micro-batch) pairs at once; "
                    f"the interleaved 1F1B schedule alternates between its stages {early} and {late} (stage {late} "
                    f"starts before stage {early} has run every micro-batch) and starts backward before its last "
                    f"forward, holding fewer than all {2 * m}")
    return None


def check_named(g: Grader, schedule: str, per_rank: list[dict], world_size: int) -> None:
    for rank, obs in enumerate(per_rank):
        for step, record in enumerate(obs["steps"]):
            problem = schedule_problem(schedule, rank, record, world_size)
            if problem:
                g.record("named-schedule", False,
                         f"{describe(schedule, world_size)}: at step {step + 1}, {problem} (rank {rank} ran: "
                         f"{_sequence(record)}; Fs.i is stage s's forward of micro-batch i, Bs.i its backward)",
                         rank=rank, world_size=world_size)
                return
    g.record("named-schedule", True)


def order_text(per_rank: list[dict], world_size: int) -> str:
    lines = [f"world size {world_size}, the last step; Fs.i is stage s's forward of micro-batch i, Bs.i its backward:"]
    for rank, obs in enumerate(per_rank):
        step = obs["steps"][-1]
        held = "1 micro-batch's" if step["peak_live"] == 1 else f"{step['peak_live']} micro-batches'"
        lines.append(f"  rank {rank}  {' '.join(labels(step))}   (peak: {held} activations)")
    return "\n".join(lines)


# --- values -----------------------------------------------------------------------------------------


def update_scale(before: dict, after: dict, ref_before: dict, ref_after: dict, names: dict) -> float | None:
    """How many times the reference's update the rank's first update is, over its parameters; None when
    it is no multiple of it (another direction) or either is zero."""
    dot = norm = got_norm = 0.0
    for key, name in names.items():
        got = (after[key] - before[key]).double()
        want = (ref_after[name] - ref_before[name]).double()
        dot += float((got * want).sum())
        norm += float((want * want).sum())
        got_norm += float((got * got).sum())
    if norm == 0 or got_norm == 0 or dot / (norm * got_norm) ** 0.5 < 1 - 1e-6:
        return None
    return dot / norm


def check_grad_scale(g: Grader, schedule: str, per_rank: list[dict], world_size: int, reference: dict,
                     names: list[dict]) -> None:
    m = rank_side.n_microbatches(world_size)
    decided = False
    for rank, obs in enumerate(per_rank):
        c = update_scale(obs["initial"], obs["steps"][0]["params"], reference["initial"], reference["states"][0],
                         names[rank])
        if c is None:
            continue  # no update, or not a multiple of the right one: matches-single-process says so
        decided = True
        if abs(c - 1) > 1e-6:
            why = ""
            if abs(c - m) < 0.01 * m:
                why = (f": {m} = n_microbatches times the gradient of the mean loss; each micro-batch's mean loss "
                       "must count 1/n_microbatches (the schedule's scale_grads=True does it)")
            elif abs(c - 1 / m) < 0.01 / m:
                why = f": 1/{m}, the micro-batches' losses divided by n_microbatches twice"
            g.record("grad-scale", False,
                     f"{describe(schedule, world_size)}: rank {rank}'s first update is {c:.4g} times that of one "
                     f"process on the whole batch's mean loss{why}", rank=rank, world_size=world_size)
            return
    if decided:
        g.record("grad-scale", True)
    else:
        g.not_checked("grad-scale", "matches-single-process", "no rank's first update is a multiple of one process's",
                      world_size=world_size)


def check_training(g: Grader, schedule: str, per_rank: list[dict], world_size: int, reference: dict,
                   names: list[dict]) -> None:
    for step in range(rank_side.STEPS):
        for rank, obs in enumerate(per_rank):
            mapped = names[rank]
            got = {mapped[k]: v for k, v in obs["steps"][step]["params"].items() if k in mapped}
            want = {n: reference["states"][step][n] for n in got}
            found = first_difference(got, want, rtol=RTOL, atol=ATOL)
            if found is None:
                continue
            message = (f"{describe(schedule, world_size)}: after step {step + 1}, rank {rank}'s {found} from one "
                       "process training the whole model on the same micro-batches")
            previous = obs["steps"][step - 1]["params"] if step else obs["initial"]
            before = {mapped[k]: v for k, v in previous.items() if k in mapped}
            if found.reason == "values" and torch.equal(got[found.name], before[found.name]):
                message += "; it did not change at this step: call optimizer.step() on every rank"
            g.record("matches-single-process", False, message, rank=rank, world_size=world_size)
            return
    g.record("matches-single-process", True)


def check_loss(g: Grader, schedule: str, per_rank: list[dict], world_size: int, reference: dict) -> None:
    last = world_size - 1
    m = rank_side.n_microbatches(world_size)
    for step in range(rank_side.STEPS):
        for rank, obs in enumerate(per_rank):
            returned = obs["steps"][step]["loss"]
            if rank != last:
                if returned["type"] != "NoneType":
                    g.record("loss-returned", False,
                             f"{describe(schedule, world_size)}: at step {step + 1} rank {rank} returned a "
                             f"{returned['type']}; only the rank holding the last stage ({last}) has the losses: the "
                             "others return None", rank=rank, world_size=world_size)
                    return
                continue
            expected = reference["losses"][step]
            if returned["type"] not in ("float", "float64") or returned["value"] is None:
                g.record("loss-returned", False,
                         f"{describe(schedule, world_size)}: at step {step + 1} the last rank ({rank}) returned a "
                         f"{returned['type']}, not a float: return the mean of the micro-batch losses as a Python "
                         "float", rank=rank, world_size=world_size)
                return
            got = returned["value"]
            if abs(got - expected) > LOSS_RTOL * abs(expected) + 1e-12:
                message = (f"{describe(schedule, world_size)}: at step {step + 1} the last rank ({rank}) returned "
                           f"{got:.10g}; the mean loss over the whole batch is {expected:.10g}")
                if abs(got - m * expected) <= 1e-6 * abs(m * expected):
                    message += f" ({m} times less: the micro-batch losses were summed, not averaged)"
                g.record("loss-returned", False, message, rank=rank, world_size=world_size)
                return
    g.record("loss-returned", True)
