"""Exercise 02's verdicts: each property of shard_indices on one example's shards, and each of the loaders'
(pure functions of what the worker returned)."""

from __future__ import annotations

from grader.rank.drivers.ex02_shard import BATCH_SIZE, LOADER_SEED

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


class Violation(Exception):
    """One example broke one check; the message is for the learner."""

    def __init__(self, check_id: str, message: str):
        super().__init__(f"{check_id}: {message}")
        self.check_id = check_id
        self.message = message


def _args(num_samples, world_size, shuffle, seed, epoch) -> str:
    return f"num_samples={num_samples}, world_size={world_size}, shuffle={shuffle}, seed={seed}, epoch={epoch}"


def _show(items, limit: int = 12) -> str:
    items = list(items)
    if len(items) <= limit:
        return "[" + ", ".join(str(i) for i in items) + "]"
    return "[" + ", ".join(str(i) for i in items[:limit]) + f", ... ({len(items)} in all)]"


def check_deterministic(n, w, seed, epoch, results) -> None:
    for first, again, shuffle in (("plain", "plain again", False), ("shuffled", "shuffled again", True)):
        for rank in range(w):
            a, b = results[first][rank]["items"], results[again][rank]["items"]
            if a != b:
                raise Violation("shard-deterministic", f"{_args(n, w, shuffle, seed, epoch)}: rank {rank} got "
                                f"{_show(a)} from one call and {_show(b)} from the next with the same arguments")


def check_in_range(n, w, seed, epoch, results) -> None:
    for name, shuffle in (("plain", False), ("shuffled", True)):
        for rank, shard in enumerate(results[name]):
            where = f"{_args(n, w, shuffle, seed, epoch)}: rank {rank}"
            if shard["kind"] not in ("list", "tuple"):
                raise Violation("shard-in-range", f"{where} got a {shard['kind']}, expected a list of ints"
                                + (" (call .tolist() on the tensor)" if shard["kind"] == "Tensor" else ""))
            if shard["bad"] is not None:
                raise Violation("shard-in-range", f"{where}'s shard holds a {shard['bad']}, expected Python "
                                "ints (call .tolist() on a tensor instead of list(tensor))")
            outside = [i for i in shard["items"] if i is None or not 0 <= i < n]
            if outside:
                raise Violation("shard-in-range", f"{where}'s shard holds {outside[0]}, outside range({n})")


def check_sizes(n, w, seed, epoch, results) -> None:
    for name, shuffle in (("plain", False), ("shuffled", True)):
        sizes = [len(shard["items"]) for shard in results[name]]
        for rank, size in enumerate(sizes):
            if size != n // w:
                raise Violation("shard-sizes", f"{_args(n, w, shuffle, seed, epoch)}: rank {rank} got {size} "
                                f"{'index' if size == 1 else 'indices'}, expected {n} // {w} = {n // w} "
                                f"(sizes of all ranks: {sizes})")


def check_disjoint(n, w, seed, epoch, results) -> None:
    for name, shuffle in (("plain", False), ("shuffled", True)):
        owner: dict = {}
        for rank, shard in enumerate(results[name]):
            for index in shard["items"]:
                if index in owner:
                    other = owner[index]
                    where = "twice in the shard of rank " + str(rank) if other == rank else \
                        f"in the shards of rank {other} and rank {rank}"
                    raise Violation("shard-disjoint", f"{_args(n, w, shuffle, seed, epoch)}: index {index} is "
                                    f"{where}")
                owner[index] = rank


def _changes(check_id, what, names, n, w, seed, epoch, results) -> None:
    """Among several epochs (or seeds), some rank must get a different set of indices."""
    if w < 2 or n < 8 * w:  # one rank has everything; tiny shards may repeat by chance
        return
    base = [set(shard["items"]) for shard in results["shuffled"]]
    if any([set(shard["items"]) for shard in results[name]] != base for name in names):
        return
    order_changed = any(results[name][r]["items"] != results["shuffled"][r]["items"]
                        for name in names for r in range(w))
    detail = ("the order inside each shard changes, but the set of indices does not: shuffle the whole "
              "range, then split it" if order_changed else "the shards do not change at all")
    raise Violation(check_id, f"num_samples={n}, world_size={w}, shuffle=True: {what}, every rank gets the same "
                    f"set of indices (rank 0: {_show(sorted(base[0]))}); {detail}")


def check_epoch_changes(n, w, seed, epoch, results) -> None:
    _changes("shard-epoch-changes", f"with seed={seed} and epochs {epoch} to {epoch + 3}",
             ["epoch+1", "epoch+2", "epoch+3"], n, w, seed, epoch, results)


def check_seed_changes(n, w, seed, epoch, results) -> None:
    _changes("shard-seed-changes", f"with epoch={epoch} and seeds {seed} to {seed + 3}",
             ["seed+1", "seed+2", "seed+3"], n, w, seed, epoch, results)


def check_seed_plus_epoch(n, w, seed, epoch, results) -> None:
    for name, (s, e) in (("all in seed", (seed + epoch, 0)), ("all in epoch", (0, seed + epoch))):
        if (s, e) == (seed, epoch):
            continue
        for rank in range(w):
            a, b = results["shuffled"][rank]["items"], results[name][rank]["items"]
            if a != b:
                raise Violation("shard-seed-plus-epoch", f"num_samples={n}, world_size={w}, shuffle=True: "
                                f"rank {rank} got {_show(a)} with seed={seed}, epoch={epoch} but {_show(b)} "
                                f"with seed={s}, epoch={e}; both must draw the permutation from a generator "
                                f"seeded with seed + epoch = {seed + epoch}")


CHECKERS = {
    "shard-deterministic": check_deterministic,
    "shard-in-range": check_in_range,
    "shard-sizes": check_sizes,
    "shard-disjoint": check_disjoint,
    "shard-epoch-changes": check_epoch_changes,
    "shard-seed-changes": check_seed_changes,
    "shard-seed-plus-epoch": check_seed_plus_epoch,
}
