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

import torch
from torch.utils.data import Dataset

from grader.checks.ex02_verdicts import CHECKERS, Violation, _show
from grader.child import RankContext
from grader.checks.interface import Grader
from grader.checks.shared.learner_errors import learner_error

# Hypothesis searches this space for shard_indices.
MAX_SAMPLES = 100
MAX_WORLD = 8
MAX_SEED = 10_000
MAX_EPOCH = 50
EXAMPLES = 80
SHRINK_STEPS = 30  # examples tried after the first violation, before the smallest one is taken
HYPOTHESIS_SEED = 2  # every grading draws the same examples
AT_ONCE_S = 3.0  # the shortcut's time (the reference takes 0.01 s); slower goes the usual way

# make_dataloader is graded on a dataset of SAMPLES_PER_RANK * world_size items.
SAMPLES_PER_RANK = 10
BATCH_SIZE = 4
LOADER_SEED = 3
EXTRA_LOADER_WORLD = 3  # an odd world size as well, whatever --world-size says

SHARD_CHECKS = [  # the order a violation is looked for in one example
    "shard-deterministic",
    "shard-in-range",
    "shard-sizes",
    "shard-disjoint",
    "shard-epoch-changes",
    "shard-seed-changes",
    "shard-seed-plus-epoch",
]
LOADER_CHECKS = ["loader-sampler", "loader-disjoint-cover", "loader-reshuffles", "loader-batch-size"]


# --- in the worker --------------------------------------------------------------------


def serve_main(ctx: RankContext) -> dict:
    from grader import probes

    with probes.platform_start_method():  # a loader with workers starts them as it would under torchrun
        ctx.serve({"shards": shards, "shards_at_once": shards_at_once, "loaders": loaders})
    return {}


def shards_at_once(ctx: RankContext, examples: list) -> list:
    """``shards`` for each (num_samples, world_size, seed, epoch), its exceptions caught."""
    return [shards(ctx, n, w, [list(c) for c in configs_for(seed, epoch).values()], catch=True)
            for n, w, seed, epoch in examples]


def shards(ctx: RankContext, num_samples: int, world_size: int, configs: list, catch: bool) -> dict:
    """Every rank's shard for each (shuffle, seed, epoch) in ``configs``.

    The indices travel as one int64 tensor (``sizes`` says how many belong to
    each (config, rank), in order): a long list of ints is slow to unpickle
    with ``weights_only``. Shards that are not a list of ints are described in
    ``odd``. With ``catch`` the learner's first exception comes back as data,
    with the arguments that raised it; without, it propagates.
    """
    shard_indices = ctx.function("shard_indices")
    flat: list = []
    sizes: list = []
    odd: list = []
    for shuffle, seed, epoch in configs:
        for rank in range(world_size):
            try:
                value = shard_indices(num_samples, rank, world_size, shuffle=shuffle, seed=seed, epoch=epoch)
            except Exception as exc:
                if not catch:
                    raise
                return {"raised": {"rank": rank, "shuffle": shuffle, "seed": seed, "epoch": epoch,
                                   "error": learner_error(exc, learner_path=ctx.learner_path)}}
            kind, items, bad = _describe(value)
            if kind != "list" or bad is not None:
                odd.append([len(sizes), kind, bad])
            flat.extend(items)
            sizes.append(len(items))
    return {"items": torch.tensor(flat, dtype=torch.int64), "sizes": sizes, "odd": odd}


INT64 = 2**63


def _describe(value) -> tuple:
    """What shard_indices returned: its type name, its items as ints (-1 where there is
    none), and the first item that is not an int (or None)."""
    kind = type(value).__name__
    if type(value) is list and all(type(v) is int for v in value) and \
            (not value or (-INT64 <= min(value) and max(value) < INT64)):
        return kind, value, None  # the usual answer, checked at C speed
    if isinstance(value, torch.Tensor):
        return kind, [int(v) for v in value.reshape(-1).tolist()], None
    try:
        raw = list(value)
    except TypeError:
        return kind, [], None
    items, bad = [], None
    for v in raw:
        if not (isinstance(v, int) and not isinstance(v, bool)) and bad is None:
            bad = f"{type(v).__name__} {v!r}"[:80]
        try:
            v = int(v)
        except (TypeError, ValueError, RuntimeError):
            v = -1
        items.append(v if -INT64 <= v < INT64 else -1)
    return kind, items, bad


class IndexDataset(Dataset):
    """Item i is the int i, so a batch is the tensor of the indices it holds."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index):
        return int(index)


def loaders(ctx: RankContext, num_samples: int, world_size: int, batch_size: int, seed: int) -> list:
    """For each rank: make_dataloader's sampler, and the batches of epoch 0 and, after set_epoch(1), epoch 1."""
    from torch.utils.data import DistributedSampler

    make_dataloader = ctx.function("make_dataloader")
    dataset = IndexDataset(num_samples)
    out = []
    for rank in range(world_size):
        obs: dict = {"rank": rank}
        out.append(obs)
        try:
            loader = make_dataloader(dataset, rank, world_size, batch_size, seed=seed)
        except NotImplementedError:
            raise
        except Exception as exc:  # e.g. a DistributedSampler that looks for a process group
            obs["raised"] = learner_error(exc, learner_path=ctx.learner_path)
            continue
        obs["loader"] = type(loader).__name__
        sampler = getattr(loader, "sampler", None)
        obs["sampler"] = None if sampler is None else type(sampler).__module__ + "." + type(sampler).__qualname__
        obs["distributed"] = isinstance(sampler, DistributedSampler)
        for name in ("num_replicas", "rank", "shuffle", "seed"):
            value = getattr(sampler, name, None)
            plain = value is None or isinstance(value, (bool, int, float, str))
            obs["sampler_" + name] = value if plain else repr(value)
        obs["epochs"] = []
        for epoch in (0, 1):
            if epoch == 1:
                if not callable(getattr(sampler, "set_epoch", None)):
                    obs["no_set_epoch"] = True
                    break
                sampler.set_epoch(1)
            try:
                obs["epochs"].append([_batch_indices(batch) for batch in loader])
            except Exception as exc:
                obs["iter_raised"] = learner_error(exc, learner_path=ctx.learner_path)
                break
    return out


def _batch_indices(batch) -> list:
    if isinstance(batch, (list, tuple)) and len(batch) == 1 and isinstance(batch[0], (torch.Tensor, list, tuple)):
        batch = batch[0]  # a loader that wraps each batch in a list
    if isinstance(batch, torch.Tensor):
        return [int(v) for v in batch.reshape(-1).tolist()]
    return [int(v) for v in batch]


# --- in the grader --------------------------------------------------------------------


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


def configs_for(seed: int, epoch: int) -> dict:
    """Named (shuffle, seed, epoch) argument sets computed for one example."""
    return {
        "plain": (False, seed, epoch),
        "plain again": (False, seed, epoch),
        "shuffled": (True, seed, epoch),
        "shuffled again": (True, seed, epoch),
        "epoch+1": (True, seed, epoch + 1),
        "epoch+2": (True, seed, epoch + 2),
        "epoch+3": (True, seed, epoch + 3),
        "seed+1": (True, seed + 1, epoch),
        "seed+2": (True, seed + 2, epoch),
        "seed+3": (True, seed + 3, epoch),
        "all in seed": (True, seed + epoch, 0),
        "all in epoch": (True, 0, seed + epoch),
    }


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


def _call_text(rank, world_size) -> str:
    return f"make_dataloader(dataset, rank={rank}, world_size={world_size}, batch_size={BATCH_SIZE}, " \
           f"seed={LOADER_SEED})"


def check_loaders(g, observations: list, n: int, world_size: int) -> None:
    broken = next((o for o in observations if "raised" in o or "iter_raised" in o), None)
    if broken is not None:
        rank = broken["rank"]
        if "raised" in broken:
            message = f"{_call_text(rank, world_size)} raised {broken['raised']}"
            if "process group" in broken["raised"]:
                message += " (there is no process group here: give DistributedSampler num_replicas= and rank=)"
        else:
            message = f"iterating the loader of {_call_text(rank, world_size)} raised {broken['iter_raised']}"
        g.record("loader-sampler", False, message, rank=rank, world_size=world_size)
        for check_id in LOADER_CHECKS[1:]:
            g.record(check_id, False, f"no loader to read: {message.split(' raised ')[0]} raised "
                     f"{message.split(' raised ')[1].split(':')[0]} (see loader-sampler)",
                     rank=rank, world_size=world_size)
        return
    check_sampler(g, observations, n, world_size)
    check_disjoint_cover(g, observations, n, world_size)
    check_reshuffles(g, observations, world_size)
    check_batch_size(g, observations, world_size)


def _expected_order(n: int, rank: int, world_size: int, epoch: int) -> list:
    """What DistributedSampler(num_replicas=world_size, rank=rank, shuffle=True, seed=LOADER_SEED) serves."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=LOADER_SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


def check_sampler(g, observations: list, n: int, world_size: int) -> None:
    for obs in observations:
        rank = obs["rank"]
        call = _call_text(rank, world_size)
        if obs["sampler"] is None:
            g.record("loader-sampler", False, f"{call} returned a {obs['loader']}, which has no .sampler "
                     "(return the DataLoader)", rank=rank, world_size=world_size)
            continue
        if not obs["distributed"]:
            g.record("loader-sampler", False, f"{call}: loader.sampler is a {obs['sampler']}, not a "
                     "DistributedSampler", rank=rank, world_size=world_size)
            continue
        wrong = [f"{name}={obs['sampler_' + name]!r} (expected {want!r})" for name, want in
                 (("num_replicas", world_size), ("rank", rank), ("shuffle", True), ("seed", LOADER_SEED))
                 if obs["sampler_" + name] != want]
        if wrong:
            g.record("loader-sampler", False, f"{call}: the sampler has " + ", ".join(wrong),
                     rank=rank, world_size=world_size)
            continue
        served = [i for batch in obs["epochs"][0] for i in batch]
        expected = _expected_order(n, rank, world_size, 0)
        g.record("loader-sampler", served == expected, f"{call}: epoch 0 served {_show(served)}, but its "
                 f"DistributedSampler yields {_show(expected)}: the loader does not read in the sampler's order",
                 rank=rank, world_size=world_size)


def check_disjoint_cover(g, observations: list, n: int, world_size: int) -> None:
    for epoch in range(min(len(o["epochs"]) for o in observations)):
        owner: dict = {}
        problem = None
        for obs in observations:
            for i in (i for batch in obs["epochs"][epoch] for i in batch):
                if i in owner and problem is None:
                    other = owner[i]
                    problem = (f"epoch {epoch}: index {i} was served "
                               + (f"twice to rank {other}" if other == obs["rank"] else
                                  f"to rank {other} and to rank {obs['rank']}"), obs["rank"])
                owner.setdefault(i, obs["rank"])
        missing = [i for i in range(n) if i not in owner]
        counts = [sum(len(b) for b in o["epochs"][epoch]) for o in observations]
        if problem is None and missing:
            problem = (f"epoch {epoch}: {len(missing)} of {n} indices were served to no rank "
                       f"({_show(missing, 8)})", None)
        if problem is not None:
            g.record("loader-disjoint-cover", False, f"{problem[0]} (dataset of {n}, world_size={world_size}; "
                     f"items served per rank: {counts})", rank=problem[1], world_size=world_size)
            return
    g.record("loader-disjoint-cover", True)


def check_reshuffles(g, observations: list, world_size: int) -> None:
    for obs in observations:
        rank = obs["rank"]
        if obs.get("no_set_epoch"):
            what = f"loader.sampler ({obs['sampler']})" if obs["sampler"] else f"the {obs['loader']} returned"
            g.record("loader-reshuffles", False, f"rank {rank}: {what} has no set_epoch",
                     rank=rank, world_size=world_size)
            return
        first, second = ([i for b in batches for i in b] for batches in obs["epochs"])
        if first == second:
            g.record("loader-reshuffles", False, f"rank {rank}: after loader.sampler.set_epoch(1) the loader "
                     f"served the same order as in epoch 0: {_show(first)}", rank=rank, world_size=world_size)
            return
    g.record("loader-reshuffles", True)


def check_batch_size(g, observations: list, world_size: int) -> None:
    for obs in observations:
        rank = obs["rank"]
        got = [len(b) for b in obs["epochs"][0]]
        total = sum(got)
        expected = [BATCH_SIZE] * (total // BATCH_SIZE) + ([total % BATCH_SIZE] if total % BATCH_SIZE else [])
        if got != expected:
            g.record("loader-batch-size", False, f"rank {rank}: {_call_text(rank, world_size)} served batches of "
                     f"sizes {got}, expected {expected} for {total} items", rank=rank, world_size=world_size)
            return
    g.record("loader-batch-size", True)
