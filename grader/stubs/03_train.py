"""Exercise 03: train a model with DistributedDataParallel.

The grader starts `world_size` processes and calls, in each,

    train_ddp(rank, world_size, model_fn=..., dataset=..., epochs=..., batch_size=...,
              lr=..., checkpoint_path=...)

with no process group yet. train_ddp must:
  1. join the group (setup_ddp) and build the model with model_fn();
  2. wrap it in DistributedDataParallel;
  3. read `dataset` (items are (x, y), y a class index) through a shuffling
     DistributedSampler, calling sampler.set_epoch(epoch) at the start of every
     epoch, in per-rank batches of `batch_size`;
  4. train with torch.optim.SGD(lr=lr) (no momentum) on nn.CrossEntropyLoss;
  5. after training, save the unwrapped model's state_dict() to
     `checkpoint_path` from rank 0 only;
  6. leave the group (cleanup_ddp) and return the trained, unwrapped model.

setup_ddp / cleanup_ddp are as in exercise 01 (copy yours), so this file stands alone.
Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/03_train.py      (stuck? ddp-grade hint 03)
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    # TODO: as in exercise 01.
    raise NotImplementedError


def cleanup_ddp() -> None:
    # TODO: as in exercise 01.
    raise NotImplementedError


def train_ddp(rank: int, world_size: int, model_fn, dataset, epochs: int, batch_size: int, lr: float,
              checkpoint_path: str) -> torch.nn.Module:
    # TODO: join the group, wrap model_fn() in DDP, shard the data with a
    # DistributedSampler (set_epoch every epoch), train with SGD on
    # CrossEntropyLoss, save from rank 0 only, leave the group, return the model.
    raise NotImplementedError
