"""Exercise 02: shard_indices / make_dataloader.

No process group: one worker process runs the learner's functions on request.
shard_indices is probed with Hypothesis in the grader's process (one call to
the worker per example, computing every rank's shard for a dozen argument
sets); make_dataloader is called for every rank of a world from that one
process. Every verdict is decided here, from the indices the worker returned.

A shortcut first: the worker computes, in one call, every example Hypothesis
tries on an implementation that passes. Hypothesis (a fixed seed, no database)
tries the same examples in the same order until its property first fails, so
when all of them pass, Hypothesis would have found nothing either. Anything
else (a violation, an exception, a crash, a slow answer) is decided by
Hypothesis as if the shortcut had not been taken.
"""

from __future__ import annotations

import functools

from grader.rank.drivers.ex02_shard import (BATCH_SIZE, LOADER_SEED, MAX_EPOCH, MAX_SAMPLES, MAX_SEED, MAX_WORLD,
                                           SAMPLES_PER_RANK, configs_for, serve_main)
from grader.checks.ex02_shard.verdicts import CHECKERS, SHARD_CHECKS, Violation, check_loaders
from grader.checks.interface import Grader

# How Hypothesis searches the space rank.py bounds for shard_indices.
EXAMPLES = 80
SHRINK_STEPS = 30  # examples tried after the first violation, before the smallest one is taken
HYPOTHESIS_SEED = 2  # every grading draws the same examples
AT_ONCE_S = 3.0  # the shortcut's time (the reference takes 0.01 s); slower goes the usual way
EXTRA_LOADER_WORLD = 3  # an odd world size as well, whatever --world-size says


def grade(g: Grader) -> None:
    worker = g.worker(serve_main)
    try:
        # A plain call first, outside Hypothesis: a function that is not written
        # yet (or raises on the simplest input) stops the grading at once.
        g.call(worker, "shards", num_samples=10, world_size=2, configs=[[False, 0, 0], [True, 0, 0]], catch=False)
        if passes_every_example_at_once(g, worker):
            for check_id in SHARD_CHECKS:
                g.record(check_id, True)
        else:
            if not worker.alive:  # stopped by the shortcut's time limit: the usual way needs a new one
                worker = g.worker(serve_main)
            grade_shards(g, worker)
        grade_loaders(g, worker)
    finally:
        worker.close()


# shard_indices -------------------------------------------------------------------------


class _Enough(BaseException):
    """Ends the shrinking early: the smallest violation seen so far will do."""


def probed(prop):
    """``prop(num_samples, world_size, seed, epoch)`` as the Hypothesis test that probes shard_indices."""
    from hypothesis import HealthCheck, Verbosity, given, seed, settings
    from hypothesis import strategies as st

    drawn = given(num_samples=st.integers(0, MAX_SAMPLES), world_size=st.integers(1, MAX_WORLD),
                  seed=st.integers(0, MAX_SEED), epoch=st.integers(0, MAX_EPOCH))
    configured = settings(database=None, deadline=None, max_examples=EXAMPLES, verbosity=Verbosity.quiet,
                          suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    # A fixed seed, not derandomize's hash of the property's source: the shortcut's property and
    # this one must draw the same examples.
    return seed(HYPOTHESIS_SEED)(configured(drawn(prop)))


@functools.cache
def passing_examples() -> tuple:
    """The examples Hypothesis tries, in order, on an implementation that passes them all."""
    tried: list = []

    @probed
    def record(num_samples, world_size, seed, epoch):
        tried.append((num_samples, world_size, seed, epoch))

    record()
    return tuple(dict.fromkeys(tried))


def passes_every_example_at_once(g, worker) -> bool:
    """True when shard_indices passes every check on every example Hypothesis would try."""
    examples = passing_examples()
    replies = g.try_call(worker, "shards_at_once", within_s=AT_ONCE_S, examples=[list(e) for e in examples])
    if replies is None or len(replies) != len(examples):
        return False
    for (num_samples, world_size, seed, epoch), reply in zip(examples, replies):
        try:
            if "raised" in reply:
                return False
            results = _unpack(reply, list(configs_for(seed, epoch)), world_size)
            for check_id in SHARD_CHECKS:
                CHECKERS[check_id](num_samples, world_size, seed, epoch, results)
        except (Violation, LookupError, TypeError, ValueError, AttributeError):  # the usual way says which
            return False
    return True


def grade_shards(g, worker) -> None:
    from hypothesis import reject

    active = list(SHARD_CHECKS)
    replies: dict = {}  # (num_samples, world_size, seed, epoch) -> the worker's reply: each rerun repeats examples
    search: dict = {}  # of the current run: the smallest violation so far, examples tried since the first

    @probed
    def shard_property(num_samples, world_size, seed, epoch):
        example = (num_samples, world_size, seed, epoch)
        if search["best"] is not None:
            search["tried"] += 1
            if search["tried"] > SHRINK_STEPS:
                raise _Enough()  # small enough to read; more shrinking would cost seconds
        named = configs_for(seed, epoch)
        if example not in replies:
            try:
                replies[example] = g.call(worker, "shards", num_samples=num_samples, world_size=world_size,
                                          configs=[list(c) for c in named.values()], catch=True)
            except g.Stopped as stop:  # a timeout or a crash of the worker; Hypothesis lets it through
                raise g.with_context(stop, f"shard_indices was called for every rank with "
                                     f"num_samples={num_samples}, world_size={world_size}, around "
                                     f"seed={seed}, epoch={epoch}") from None
        reply = replies[example]
        try:
            if "raised" in reply:
                raised = reply["raised"]
                if "shard-sizes" not in active:
                    reject()  # already reported; look at the other checks elsewhere
                raise Violation("shard-sizes", f"shard_indices(num_samples={num_samples}, rank={raised['rank']}, "
                                f"world_size={world_size}, shuffle={raised['shuffle']}, seed={raised['seed']}, "
                                f"epoch={raised['epoch']}) raised {raised['error']}")
            results = _unpack(reply, list(named), world_size)
            for check_id in list(active):
                CHECKERS[check_id](num_samples, world_size, seed, epoch, results)
        except Violation as violation:
            size = (sum(example), example)
            if search["best"] is None or size < search["best"][0]:
                search["best"] = (size, violation)
            raise

    while active:
        search.update(best=None, tried=0)
        violation = _falsify(shard_property, search)
        if violation is None:
            break
        g.record(violation.check_id, False, violation.message)
        active.remove(violation.check_id)
    for check_id in active:
        g.record(check_id, True)


def _unpack(reply: dict, names: list, world_size: int) -> dict:
    """The worker's reply as {config name: [{"kind", "items", "bad"} for each rank]}."""
    flat = reply["items"].tolist()
    odd = {index: (kind, bad) for index, kind, bad in reply["odd"]}
    shards, start = [], 0
    for index, size in enumerate(reply["sizes"]):
        kind, bad = odd.get(index, ("list", None))
        shards.append({"kind": kind, "items": flat[start:start + size], "bad": bad})
        start += size
    return {name: shards[i * world_size:(i + 1) * world_size] for i, name in enumerate(names)}


def _falsify(prop, search: dict) -> Violation | None:
    """Run the property; the (shrunk) violation it found, or None."""
    try:
        prop()
    except Violation as violation:
        return violation
    except _Enough:
        return search["best"][1]
    except BaseException as exc:  # e.g. a Flaky error wrapping a violation that did not repeat
        found = _find_violation(exc)
        if found is None:
            raise
        return found
    return None


def _find_violation(exc: BaseException) -> Violation | None:
    if isinstance(exc, Violation):
        return exc
    for inner in getattr(exc, "exceptions", ()) or ():
        found = _find_violation(inner)
        if found is not None:
            return found
    for inner in (exc.__cause__, exc.__context__):
        if inner is not None and inner is not exc:
            found = _find_violation(inner)
            if found is not None:
                return found
    return None


# make_dataloader -----------------------------------------------------------------------


def grade_loaders(g, worker) -> None:
    sizes = sorted(set(g.world_sizes) | {EXTRA_LOADER_WORLD})
    for world_size in sizes:
        n = SAMPLES_PER_RANK * world_size
        observations = g.call(worker, "loaders", num_samples=n, world_size=world_size, batch_size=BATCH_SIZE,
                              seed=LOADER_SEED)
        check_loaders(g, observations, n, world_size)
