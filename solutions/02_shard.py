"""Exercise 02: give each rank its own part of the data.

DistributedDataParallel does not split the data: every rank runs the same
script over the same dataset, and each must read a different part of it. Write
the split twice: by hand, then with the library's sampler.

    shard_indices(num_samples, rank, world_size, *, shuffle=False, seed=0, epoch=0) -> list[int]
        The indices of the samples `rank` reads this epoch.
        - Every rank gets exactly num_samples // world_size indices; no index is
          in two ranks' shards; the remainder (num_samples % world_size) is dropped.
        - With shuffle=True, every rank draws the same permutation of
          range(num_samples) from a generator seeded with seed + epoch, then takes
          its part of it (strided or contiguous, your choice). So a rank's shard
          changes from epoch to epoch, and with the seed.
        - Ranks do not talk to each other here: each computes its shard on its
          own, so the same arguments must always give the same shard.
        - Return a list of Python ints.
    make_dataloader(dataset, rank, world_size, batch_size, *, seed=0) -> DataLoader
        A DataLoader over DistributedSampler(dataset, num_replicas=world_size,
        rank=rank, shuffle=True, seed=seed), with batch_size items per batch
        (per rank). The sampler must be reachable as loader.sampler. It may be
        called before any process group exists.

Why the two halves treat the remainder differently: both give every rank the
same number of samples, so the ranks take the same number of steps (a rank with
one batch more would wait in a collective the others never reach). shard_indices
drops the remainder, so no sample is read twice. DistributedSampler, by default
(drop_last=False), pads instead: it repeats the first indices of its order until
the count divides evenly, so each rank reads ceil(num_samples / world_size)
samples and a few are read twice per epoch. DistributedSampler(drop_last=True)
drops, as shard_indices does.

Grade it with:  ddp-grade exercises/02_shard.py
"""

import torch
from torch.utils.data import DataLoader, DistributedSampler


def shard_indices(num_samples: int, rank: int, world_size: int, *, shuffle: bool = False, seed: int = 0,
                  epoch: int = 0) -> list[int]:
    if shuffle:
        # Each rank shuffles on its own, so all of them must draw the same
        # permutation: a private generator, the same seed everywhere.
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g)
    else:
        order = torch.arange(num_samples)

    # Drop the remainder: a rank with one batch more than the others would wait
    # forever in a gradient all-reduce that the others never join.
    per_rank = num_samples // world_size
    order = order[: per_rank * world_size]

    return order[rank::world_size].tolist()


def make_dataloader(dataset, rank: int, world_size: int, batch_size: int, *, seed: int = 0) -> DataLoader:
    # Without num_replicas and rank the sampler asks the process group for
    # them, and there may be none yet.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    # The sampler already shuffles; a DataLoader takes either sampler= or shuffle=True, not both.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
