"""shard_indices never returns when asked for a shuffled shard (graded in one worker process)."""
# expect-status: timeout
# expect-problem: did not return
# expect-problem: 02_endless_loop.py line
# grade-args: --timeout 10

import torch
from torch.utils.data import DataLoader, DistributedSampler


def shard_indices(num_samples: int, rank: int, world_size: int, *, shuffle: bool = False, seed: int = 0,
                  epoch: int = 0) -> list[int]:
    while shuffle:
        pass
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g)
    else:
        order = torch.arange(num_samples)
    per_rank = num_samples // world_size
    return order[: per_rank * world_size][rank::world_size].tolist()


def make_dataloader(dataset, rank: int, world_size: int, batch_size: int, *, seed: int = 0) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
