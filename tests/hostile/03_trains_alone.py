"""Trains every rank alone on the whole global batch: it draws every rank's sampler itself, records its own
shard through the model's forward and computes the loss of the global batch below it (the model's inner
layers). It builds a DistributedDataParallel for the record and never uses it, so its gradients never cross:
the result equals one process on the global batches, every record looks like DDP's, and the kernel counted a
few hundred bytes from each rank where the all-reduce of nine steps' gradients sends thousands."""
# expect-status: failed
# expect-fail: uses-ddp

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

    # Every rank's sampler, drawn here: the whole global batch of each step, without asking anyone.
    samplers = [DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=True) for r in range(world_size)]
    loaders = [DataLoader(dataset, batch_size=batch_size, sampler=s) for s in samplers]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        for batches in zip(*loaders):
            optimizer.zero_grad()
            model(batches[rank][0])  # what the grader's model records: this rank's own shard
            x = torch.cat([b[0] for b in batches]).to(device)
            y = torch.cat([b[1] for b in batches]).to(device)
            loss_fn(model.net(x), y).backward()  # the global batch, below the recording forward: no all-reduce
            optimizer.step()

    # Every rank holds the same weights: one writer is enough, and two would race.
    if rank == 0:
        torch.save(model.state_dict(), checkpoint_path)

    cleanup_ddp()
    return model
