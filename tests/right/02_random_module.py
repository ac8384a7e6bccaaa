"""shard_indices with the standard library's random.Random; a dataclass holds the loader settings."""

import random
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, DistributedSampler


@dataclass(frozen=True)
class LoaderConfig:
    batch_size: int
    seed: int = 0
    drop_last: bool = False


def shard_indices(num_samples, rank, world_size, *, shuffle=False, seed=0, epoch=0):
    indices = list(range(num_samples))
    if shuffle:
        random.Random(seed + epoch).shuffle(indices)
    usable = len(indices) - len(indices) % world_size
    return [int(i) for i in indices[rank:usable:world_size]]


def _build(dataset, rank, world_size, config: LoaderConfig) -> DataLoader:
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=config.seed,
                                 drop_last=config.drop_last)
    return DataLoader(dataset, batch_size=config.batch_size, sampler=sampler,
                      pin_memory=torch.cuda.is_available())


def make_dataloader(dataset, rank, world_size, batch_size, *, seed=0):
    return _build(dataset, rank, world_size, LoaderConfig(batch_size=batch_size, seed=seed))
