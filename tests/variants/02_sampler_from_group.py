"""Exercise 02, broken: the DistributedSampler asks the (missing) process group for the rank and world size."""
# expect-fail: loader-sampler loader-disjoint-cover

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
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
