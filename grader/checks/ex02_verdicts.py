"""Exercise 02's shard checks, as pure functions of one example's results: each raises a
:class:`Violation` naming its check and what was observed. :mod:`grader.checks.ex02_shard` runs
them on every example Hypothesis draws."""

from __future__ import annotations


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
