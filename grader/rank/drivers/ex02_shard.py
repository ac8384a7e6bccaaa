"""Exercise 02, the worker's side: the learner's shard_indices and make_dataloader called on request, their
answers returned as plain data (no process group)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from grader.rank.drivers.shared.learner_errors import learner_error
from grader.rank.child import RankContext

# Hypothesis searches this space for shard_indices.
MAX_SAMPLES = 100
MAX_WORLD = 8
MAX_SEED = 10_000
MAX_EPOCH = 50

# make_dataloader is graded on a dataset of SAMPLES_PER_RANK * world_size items.
SAMPLES_PER_RANK = 10
BATCH_SIZE = 4
LOADER_SEED = 3


def serve_main(ctx: RankContext) -> dict:
    from grader.rank import probes

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
