"""Exercise 03, saved with Windows line endings (CRLF); the loop written with enumerate and set_to_none.

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
Grade it with:  ddp-grade exercises/03_train.py
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend is None:
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
        backend = "nccl" if enough_gpus else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def train_ddp(rank: int, world_size: int, model_fn, dataset, epochs: int, batch_size: int, lr: float,
              checkpoint_path: str) -> torch.nn.Module:
    setup_ddp(rank, world_size)
    use_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    # DDP copies rank 0's weights to every rank here, so all replicas start equal.
    model = model_fn().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if use_cuda else None)

    # Each rank reads its own 1/world_size of the data; the sampler shuffles.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(epochs):
        # The shuffle is seeded with seed + epoch: without this, every epoch repeats epoch 0's order.
        sampler.set_epoch(epoch)
        for step, batch in enumerate(loader):
            x, y = (t.to(device) for t in batch)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp_model(x), y)
            loss.backward()  # gradients are averaged across ranks during this call
            optimizer.step()

    # Every rank holds the same weights: one writer is enough, and two would race.
    if rank == 0:
        torch.save(ddp_model.module.state_dict(), checkpoint_path)

    cleanup_ddp()
    return ddp_model.module
