"""Exercise 02, broken: the shard is returned as a tensor, not a list of ints."""
# expect-fail: shard-in-range

import torch
from torch.utils.data import DataLoader, DistributedSampler


def shard_indices(num_samples: int, rank: int, world_size: int, *, shuffle: bool = False, seed: int = 0,
                  epoch: int = 0) -> list[int]:
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g)
    else:
        order = torch.arange(num_samples)
    per_rank = num_samples // world_size
    order = order[: per_rank * world_size]
    return order[rank::world_size]


def make_dataloader(dataset, rank: int, world_size: int, batch_size: int, *, seed: int = 0) -> DataLoader:
    # Without num_replicas and rank the sampler asks the process group for
    # them, and there may be none yet.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    # The sampler already shuffles; a DataLoader takes either sampler= or shuffle=True, not both.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
