"""Exercise 02, broken: each rank shuffles its own fixed contiguous block, so its samples never change."""
# expect-fail: shard-epoch-changes shard-seed-changes

import torch
from torch.utils.data import DataLoader, DistributedSampler


def shard_indices(num_samples: int, rank: int, world_size: int, *, shuffle: bool = False, seed: int = 0,
                  epoch: int = 0) -> list[int]:
    per_rank = num_samples // world_size
    block = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        block = block[torch.randperm(per_rank, generator=g)]
    return block.tolist()


def make_dataloader(dataset, rank: int, world_size: int, batch_size: int, *, seed: int = 0) -> DataLoader:
    # Without num_replicas and rank the sampler asks the process group for
    # them, and there may be none yet.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    # The sampler already shuffles; a DataLoader takes either sampler= or shuffle=True, not both.
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
