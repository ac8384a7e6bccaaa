"""Contiguous blocks of a NumPy permutation; a loader with worker processes."""

from __future__ import annotations

import numpy as np
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def shard_indices(num_samples: int, rank: int, world_size: int, *, shuffle: bool = False, seed: int = 0,
                  epoch: int = 0) -> list[int]:
    if shuffle:
        order = np.random.default_rng(seed + epoch).permutation(num_samples)
    else:
        order = np.arange(num_samples)
    per_rank = num_samples // world_size
    start = rank * per_rank
    return order[start:start + per_rank].tolist()


def make_dataloader(dataset: Dataset, rank: int, world_size: int, batch_size: int, *, seed: int = 0) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False, num_workers=2,
                      persistent_workers=False)
