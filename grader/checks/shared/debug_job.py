"""The debugging track: run a learner's training script as torchrun would, and read what it did.

Every exercise of the track (21 and up) is a short script with ``main(argv)``. Its drivers call
:func:`grader.rank.drivers.shared.debug_rank.run_job` in each rank, its checks :func:`read_job` here,
in the grader.

Rank side (:mod:`grader.rank.drivers.shared.debug_rank`): set the variables torchrun sets, write the inputs the script reads
(a data file, a checkpoint to resume from), install probes, import the script and call
``main(["--data", ..., "--out", ..., "--epochs", ...])``. The probes record, in order:

* ``ddp``      each DistributedDataParallel built: its options;
* ``batch``    each batch a DataLoader hands out (which loader, which pass over it);
* ``forward``  each forward of the wrapped model with gradients enabled: the input rows;
* ``sync``     each gradient all-reduce DDP makes (a communication hook of the grader's own);
* ``step``     each optimizer step, with the learning rate of its first parameter group;
* collectives the script calls itself (``op``, bytes).

A collective that waits :data:`.debug_rank.COLLECTIVE_WAIT_S` for its peers is what a hang looks like: the
process group's timeout is lowered to that after the script joins, so gloo raises where the rank
waits, and the exception (with the line of the script and the collective) is recorded rather than
the rank being killed at the grader's deadline. Whatever ``main`` raises is recorded the same way.

Grader side: :func:`read_job` turns the outcome into a :class:`Job` (each rank's record, how each
rank ended), and the helpers below find the steps, epochs and samples, replay the training in one
process and describe, for a failure message, where each rank was.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from grader import diagnose
from grader.rank import untrusted
from grader.checks.shared import timelines
from grader.rank.drivers.shared.debug_rank import LOG_NAME
from grader.checks.shared.debug_replay import load_into, replay
from grader.rank.drivers.shared.recording import cpu_state
from grader.rank.outcomes import describe_exit


# --- in the grader --------------------------------------------------------------------


@dataclass
class RankEnd:
    """How one rank's job ended."""

    rank: int
    finished: bool  # main returned
    raised: dict | None = None  # what main raised (type, message, where, waiting_in, after_s)
    crashed: str = ""  # the process died: the signal or exit code, in words
    where: str = ""  # for a crash or a stop: the script's line it was at, from its stack
    killed: bool = False  # the grader stopped it (after another rank failed)
    cause: str = ""  # for a crash: what its output says about why


@dataclass
class Job:
    """One run of the script on every rank."""

    world_size: int
    records: list  # each rank's dict from run_job, None when the rank sent none
    ends: list[RankEnd]
    run_dir: str
    learner: str = ""
    index_of: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(e.finished for e in self.ends)

    def log(self) -> list[dict]:
        """What rank 0 appended to --out/log.jsonl, one dict a line (lines that are not JSON skipped)."""
        return read_log(os.path.join(self.run_dir, "out", LOG_NAME))


def read_log(path: str) -> list[dict]:
    try:
        values = untrusted.read_json_lines(path)
    except untrusted.Unreadable:  # none, a link, a FIFO, too large: no log the grader can read
        return []
    return [value for value in values if isinstance(value, dict)]


def read_job(g, outcome, x_rows: torch.Tensor | None = None) -> Job:
    """The outcome of a run of :func:`run_job` as a :class:`Job`.

    A rank whose driver itself failed (the script does not import, lacks main) stops the
    grading as for any exercise; a rank that crashed or was stopped is recorded.
    """
    for r in outcome.ranks:
        if r.status == "error":
            g.stop_on_failures(outcome)
    timelines.keep(g, outcome, f"the job on {outcome.world_size} ranks")
    ends, records = [], []
    for r in outcome.ranks:
        record = r.result if r.status == "ok" else None
        records.append(record)
        if record is not None:
            ends.append(RankEnd(r.rank, record["raised"] is None, record["raised"]))
            continue
        where = _stack_line(r.stack, g.path)
        if r.status == "exited":
            cause = ""
            if any(m in r.output for m in SIZE_MISMATCH):
                cause = "gloo found that the collective it met on another rank moved data of another size"
            ends.append(RankEnd(r.rank, False, crashed=describe_exit(r.exitcode, r.limit_detail), where=where,
                                cause=cause))
        else:
            ends.append(RankEnd(r.rank, False, where=where, killed=True))
    index_of = {}
    if x_rows is not None:
        index_of = {row.numpy().tobytes(): i for i, row in enumerate(x_rows)}
    return Job(outcome.world_size, records, ends, outcome.run_dir, os.path.basename(g.path), index_of)


def _stack_line(stack: str, learner_path: str) -> str:
    frames = diagnose.main_thread_frames(stack) if stack.strip() else []
    mine = [f for f in frames if os.path.abspath(f[0]) == os.path.abspath(learner_path)]
    if not mine:
        return ""
    import linecache

    path, line, function = mine[0]
    code = linecache.getline(path, line).split("  #")[0].strip()
    return f"{function}(), line {line}" + (f" `{code}`" if code else "")


def _where_text(where: dict | None) -> str:
    if not where:
        return ""
    code = str(where.get("code") or "").split("  #")[0].strip()
    return f"{where.get('function')}(), line {where.get('line')}" + (f" `{code}`" if code else "")


def _wait_words(waiting: str) -> str:
    if waiting == "backward":
        return "the gradient all-reduce of loss.backward()"
    if waiting == "forward":
        return "DDP's forward"
    return f"dist.{waiting}" if waiting else ""


TIMED_OUT = ("Timed out waiting", "timed out", "Timeout", "timeout")
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
SIZE_MISMATCH = ("doesn't match expected size", "collective mismatch")


def _waited(end: RankEnd) -> str:
    """The collective a rank gave up waiting in (its peer timed out or left), "" when it did not."""
    raised = end.raised or {}
    message = str(raised.get("message", ""))
    if raised.get("waiting_in") and any(t in message for t in TIMED_OUT + PEER_GONE):
        return raised["waiting_in"]
    return ""


def describe_end(end: RankEnd) -> str:
    """One rank's end, in words: where it waited or what it raised."""
    return f"rank {end.rank} {_end_words(end)}"


def _end_words(end: RankEnd) -> str:
    if end.finished:
        return "finished"
    if end.crashed:
        where = f" at {end.where}" if end.where else ""
        cause = f": {end.cause}" if end.cause else ""
        return f"{end.crashed}{where}{cause}"
    if end.killed:
        where = f" (at {end.where})" if end.where else ""
        return f"was still running{where} and was stopped"
    raised = end.raised or {}
    where = _where_text(raised.get("where"))
    at = f" at {where}" if where else ""
    waited = _waited(end)
    if waited:
        return f"waited in {_wait_words(waited)}{at}"
    return f"raised {raised.get('type', 'an exception')}{at}: {_gist(str(raised.get('message', '')))}"


def _gist(message: str) -> str:
    """An exception's message cut to its first sentence, plus any line naming parameters."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    first = lines[0]
    cut = first.find(". ")
    first = first[:cut + 1] if 0 < cut < 300 else first[:300]
    named = [ln for ln in lines[1:] if ln.startswith("Parameter")]
    return " ".join([first, *named[:2]])


def hung(job: Job) -> bool:
    """Some rank gave up waiting in a collective (its own timeout, or its peer's)."""
    return any(_waited(e) for e in job.ends)


def ends_message(job: Job) -> str:
    """Every rank's end in one sentence (ranks that ended alike together, finished ones last),
    and whether the ranks waited in different collectives."""
    groups: dict[str, list[int]] = {}
    for end in job.ends:
        if not end.finished:
            groups.setdefault(_end_words(end), []).append(end.rank)
    parts = [f"{rank_list(ranks)} {words}" for words, ranks in groups.items()]
    done = [e.rank for e in job.ends if e.finished]
    if done:
        parts.append(f"{rank_list(done)} finished main()")
    text = "; ".join(parts)
    waits = {_waited(e) for e in job.ends if _waited(e)}
    if len(waits) > 1:
        text += " (the ranks were in different collectives)"
    return text


def rank_list(ranks: list[int]) -> str:
    """"rank 0", "ranks 0 and 1", "ranks 0, 1 and 2"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


# --- steps, epochs and samples ---------------------------------------------------------


def ids_of(x: torch.Tensor | None, index_of: dict) -> list[int]:
    """The dataset rows in ``x`` as sample indices (-1 for a row not in the training set)."""
    if x is None:
        return []
    rows = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(1, -1)
    return [index_of.get(row.numpy().tobytes(), -1) for row in rows]


@dataclass
class Step:
    """One optimizer step of one rank: the micro-batches (sample ids) whose forwards fed it."""

    micro: list[list[int]]
    syncs: int  # backward passes that all-reduced gradients since the previous step
    epoch: tuple | None  # (loader, pass) the step's batches came from; None when no DataLoader was seen


def steps_of(record: dict, index_of: dict) -> tuple[list[Step], list[list[int]]]:
    """This rank's optimizer steps, in order, and the forwards after its last step (not stepped).

    The training forwards since the previous step are its micro-batches; a backward counts as
    synced once for each backward pass that all-reduced (several buckets are one pass).
    """
    model = record.get("trained")
    steps: list[Step] = []
    micro: list[list[int]] = []
    synced_after: set[int] = set()  # forward counts at which a sync happened
    epoch = None
    forwards = 0
    for event in record["events"]:
        what = event.get("what", "collective")
        if what == "batch":
            epoch = (event["loader"], event["pass"])
        elif what == "forward" and event["ddp"] == model:
            micro.append(ids_of(event["x"], index_of))
            forwards += 1
        elif what == "sync" and event["ddp"] == model:
            synced_after.add(forwards)
        elif what == "step" and micro:
            steps.append(Step(micro, len(synced_after), epoch))
            micro, synced_after = [], set()
    return steps, micro


def epochs_of(steps: list[Step], epochs: int) -> list[list[Step]]:
    """The steps grouped by the pass over a DataLoader they came from, in order of first use.

    Without any DataLoader (batches sliced by hand), the steps are split evenly into ``epochs``.
    """
    if steps and all(s.epoch is None for s in steps):
        per = max(1, -(-len(steps) // epochs))
        return [steps[i:i + per] for i in range(0, len(steps), per)]
    groups: dict = {}
    for s in steps:
        groups.setdefault(s.epoch, []).append(s)
    return list(groups.values())


def samples(epoch: list[Step]) -> list[int]:
    return [i for s in epoch for m in s.micro for i in m]


def data_split_verdict(steps: list[list[Step]], world_size: int, num_samples: int, epochs: int,
                       batch_size: int) -> tuple[bool, str]:
    """In every epoch each sample trains on one rank: at most world_size - 1 repeats (a sampler's
    padding) and at most world_size * batch_size - 1 samples left out (a dropped remainder)."""
    grouped = [epochs_of(rank_steps, epochs) for rank_steps in steps]
    if any(len(g) != epochs for g in grouped):
        return False, "the ranks trained " + ", ".join(f"rank {r}: {len(g)}" for r, g in enumerate(grouped)) + \
            f" epochs, expected {epochs}"
    for epoch in range(epochs):
        owners: dict[int, list[int]] = {}
        counts: Counter = Counter()
        for rank, g in enumerate(grouped):
            for i in samples(g[epoch]):
                counts[i] += 1
                owners.setdefault(i, [])
                if rank not in owners[i]:
                    owners[i].append(rank)
        if -1 in counts:
            return False, f"epoch {epoch}: some training batches hold rows that are not in the data set"
        repeats = sum(counts.values()) - len(counts)
        if repeats > world_size - 1:
            shared = next((i for i, r in owners.items() if len(r) > 1), None)
            if shared is not None:
                return False, (f"epoch {epoch}: sample {shared} was trained on by {rank_list(owners[shared])}, "
                               f"and {repeats} samples in all were repeated: "
                               "each rank must train on its own part of the data")
            twice = next(i for i, c in counts.items() if c > 1)
            return False, f"epoch {epoch}: sample {twice} was trained on {counts[twice]} times"
        unused = sorted(set(range(num_samples)) - set(counts))
        if len(unused) > world_size * batch_size - 1:
            return False, (f"epoch {epoch}: {len(unused)} of {num_samples} samples were not trained on "
                           f"(e.g. {', '.join(map(str, unused[:5]))}); at most a remainder smaller than one global "
                           f"batch ({world_size} x {batch_size}) may be left out")
    return True, ""


# --- inputs and the checks every exercise of the track shares ---------------------------


def check_finishes(g, job: Job, check_id: str = "finishes") -> bool:
    """Every rank's main() returned; otherwise the check fails with where each rank was."""
    if job.ok:
        g.record(check_id, True)
        return True
    crashed_or_raised = any(not e.finished and not _waited(e) and not e.killed for e in job.ends)
    what = "failed" if crashed_or_raised or not hung(job) else "hung (collectives waited for peers that never came)"
    forwards = training_forwards(job)
    known = [n for n in forwards if n is not None]
    counts = ""
    if len(set(known)) > 1:
        counts = " (training forwards so far: " + ", ".join(
            f"rank {r}: {n}" for r, n in enumerate(forwards) if n is not None) + ")"
    g.record(check_id, False, f"with {job.world_size} processes the job {what}: {ends_message(job)}{counts}",
             rank=next(e.rank for e in job.ends if not e.finished), world_size=job.world_size)
    return False


def not_checked(g, job: Job, check_ids) -> None:
    """Checks that need a finished job are not checked (neither passed nor failed), pointing at finishes."""
    for check_id in check_ids:
        g.not_checked(check_id, "finishes", f"the job did not finish with {job.world_size} processes (see finishes)",
                      world_size=job.world_size)


def trained_model(job: Job, rank: int) -> tuple[dict | None, dict | None]:
    """(state at its first training forward, state at the end) of the model this rank trained in DDP."""
    record = job.records[rank]
    if record is None or record.get("trained") is None:
        return None, None
    index = record["trained"]
    return record["first_states"][index], record["final_states"][index]


def check_built_ddp(g, job: Job, check_id: str) -> bool:
    """Every rank trained a model wrapped in DistributedDataParallel (else ``check_id`` fails)."""
    for rank, record in enumerate(job.records):
        if record is not None and record.get("trained") is None:
            g.record(check_id, False, f"rank {rank} never built a DistributedDataParallel: the script must "
                     "train its model through DDP", rank=rank, world_size=job.world_size)
            return False
    return True


def check_params_identical(g, job: Job, check_id: str = "params-identical") -> bool:
    """After main() returned, the trained model (parameters and buffers) is bit-identical on every rank."""
    from grader.compare import first_difference

    _, reference = trained_model(job, 0)
    for rank in range(1, job.world_size):
        _, final = trained_model(job, rank)
        if reference is None or final is None:
            continue
        found = first_difference(final, reference)
        if found is not None:
            g.record(check_id, False, f"after training, rank {rank}'s model differs from rank 0's: {found}",
                     rank=rank, world_size=job.world_size)
            return False
    g.record(check_id, True)
    return True


def per_rank_steps(job: Job) -> list[tuple[list[Step], list[list[int]]]]:
    return [steps_of(record, job.index_of) for record in job.records]


def step_counts(steps: list[list[Step]]) -> str:
    return ", ".join(f"rank {r}: {len(s)}" for r, s in enumerate(steps))


def check_replay(g, job: Job, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, lr: float, loss_fn,
                 check_id: str = "matches-replay", tolerance: float = 1e-5, momentum: float = 0.0,
                 buffers: list | None = None, start: dict | None = None, after_step=None, explain=None,
                 uneven_epochs: int | None = None) -> bool:
    """The model rank 0 ends with equals the grader's replay of the same steps in one process.

    The replay starts from ``start`` (default: rank 0's model at its first training step) and takes,
    at each step, every rank's micro-batches of that step. With ``uneven_epochs`` (the number of
    epochs) the ranks may take different numbers of steps in an epoch (as under Join): steps are
    matched within each epoch, and a rank past its last step contributes nothing. ``explain(per_rank, start, final)``
    may add, to a failure, what the model does match (e.g. another loss).
    """
    from grader.compare import largest_difference

    first, final = trained_model(job, 0)
    if final is None:
        g.record(check_id, False, "rank 0 trained no model in DDP", rank=0, world_size=job.world_size)
        return False
    misfit = load_into(model, start if start is not None else first)
    if misfit:
        g.record(check_id, False, f"the model is not the script's: {misfit} (keep the model as it is)",
                 rank=0, world_size=job.world_size)
        return False
    steps = [s for s, _ in per_rank_steps(job)]
    if uneven_epochs is not None:
        per_rank, why = aligned_by_epoch(steps, uneven_epochs)
        if why:
            g.record(check_id, False, why, world_size=job.world_size)
            return False
    elif len({len(s) for s in steps}) != 1:
        g.record(check_id, False, f"the ranks took different numbers of optimizer steps ({step_counts(steps)})",
                 world_size=job.world_size)
        return False
    else:
        per_rank = [[step.micro for step in rank_steps] for rank_steps in steps]
    replay(model, per_rank, x, y, lr=lr, loss_fn=loss_fn, momentum=momentum, buffers=buffers,
           after_step=after_step)
    found = largest_difference(final, cpu_state(model))
    if found is None or found.max_abs <= tolerance:
        g.record(check_id, True)
        return True
    extra = explain(per_rank, start if start is not None else first, final) if explain else ""
    g.record(check_id, False, f"after {len(per_rank[0])} steps, rank 0's model differs from one process "
             f"training on the same global batches: {found} (tolerance {tolerance:g})" + (f"; {extra}" if extra else ""),
             rank=0, world_size=job.world_size)
    return False


def aligned_by_epoch(steps: list[list[Step]], epochs: int) -> tuple[list, str]:
    """Each rank's micro-batches per global step, steps matched within each epoch ("" or why not)."""
    grouped = [epochs_of(rank_steps, epochs) for rank_steps in steps]
    counts = {len(g) for g in grouped}
    if len(counts) != 1:
        return [], "the ranks trained different numbers of epochs: " + ", ".join(
            f"rank {r}: {len(g)}" for r, g in enumerate(grouped))
    per_rank: list[list] = [[] for _ in steps]
    for epoch in range(counts.pop()):
        longest = max(len(g[epoch]) for g in grouped)
        for rank, g in enumerate(grouped):
            micro = [s.micro for s in g[epoch]]
            per_rank[rank] += micro + [[]] * (longest - len(micro))
    return per_rank, ""


def training_forwards(job: Job) -> list[int | None]:
    """How many training forwards each rank ran (None for a rank that sent no record)."""
    counts = []
    for record in job.records:
        if record is None:
            counts.append(None)
            continue
        model = record.get("trained")
        counts.append(sum(1 for e in record["events"] if e.get("what") == "forward" and e["ddp"] == model))
    return counts


def same_state(a: dict, b: dict, tolerance: float = 1e-5) -> bool:
    from grader.compare import largest_difference

    found = largest_difference(a, b)
    return found is None or found.max_abs <= tolerance


# --- the template of an exercise of the track ------------------------------------------
#
# An exercise of the track is its drivers, grader/rank/drivers/exNN_slug.py (its constants, ``make_data``:
# the data file its runs read, and ``rank_main = debug_rank.job_driver(make_data, EPOCHS)``, or a driver of
# its own when the script reads more), and its checks, grader/checks/exNN_slug.py: ``grade(g)`` looping
# over ``finished_jobs``, judging what is particular to its symptom, then
# ``check_params_identical`` and ``check_replay`` with ``stub_models.TwoLayerNet`` and ``cross_entropy``.


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    """The scripts' loss, as :func:`check_replay` calls it."""
    return torch.nn.functional.cross_entropy(model(x), y)


def finished_jobs(g, driver, data: dict, other_checks, *, before=None):
    """Each world size's job (``driver`` run on its ranks), read, for the checks that need a finished one. A job that did not finish
    fails ``finishes``, leaves ``other_checks`` not checked and ends the loop. ``before(g, job)`` judges
    what is seen whether the job finished or not."""
    for world_size in g.world_sizes:
        job = read_job(g, g.run(driver, world_size, expect_ok=False), data["train_x"])
        if before is not None:
            before(g, job)
        if not check_finishes(g, job):
            not_checked(g, job, other_checks)
            return
        yield job
