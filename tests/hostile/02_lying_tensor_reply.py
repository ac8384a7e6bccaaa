"""A right answer whose worker answers every call with a tensor that claims 5*10^7 int64 elements on a
storage of 8 bytes (as a pickle rebuilt through set_, such a tensor took the grader to 2.1 GB when
02's check called .tolist() on it). A tensor's bytes must be exactly what its dtype and shape need:
the reply is refused before anything is allocated."""
# expect-status: failed
# expect-problem: could not read this rank's report
# expect-problem: shape [50000000] needs 400,000,000 bytes, and its storage has 8
# grade-args: --timeout 60

import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler

HEADER = (b'{"status":"ok","result":{"\\u0000":"tensor","dtype":"int64","shape":[50000000],"n":8}}')
MESSAGE = b"DDPW" + len(HEADER).to_bytes(8, "little") + HEADER + b"\x01" * 8


def _forge() -> None:
    """Whatever this process sends is MESSAGE: the grader's encoder, in this process, is the learner's to patch."""
    sys.modules["grader.rank.wire"].dumps = lambda payload: MESSAGE


_forge()


def shard_indices(num_samples: int, rank: int, world_size: int, *, shuffle: bool = False, seed: int = 0,
                  epoch: int = 0) -> list[int]:
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
