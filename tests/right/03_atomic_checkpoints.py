"""train_ddp with a dataclass for its settings and type hints throughout; rank 0 writes a checkpoint
after every epoch, atomically: to a temporary file in the same folder, then os.replace."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class TrainConfig:
    epochs: int
    batch_size: int
    lr: float
    checkpoint_path: str
    checkpoint_every: int = 1


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def save_atomically(state: dict[str, torch.Tensor], path: str) -> None:
    """Never leave a half-written file at `path`: write next to it, then rename over it."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise


def run_epoch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
              loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device) -> None:
    model.train()
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()


def train_ddp(rank: int, world_size: int, model_fn: Callable[[], nn.Module], dataset: Dataset, epochs: int,
              batch_size: int, lr: float, checkpoint_path: str) -> nn.Module:
    config = TrainConfig(epochs=epochs, batch_size=batch_size, lr=lr, checkpoint_path=checkpoint_path)
    setup_ddp(rank, world_size)
    use_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    model: DistributedDataParallel = DistributedDataParallel(model_fn().to(device),
                                                             device_ids=[device.index] if use_cuda else None)
    sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=config.batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)
        run_epoch(model, loader, optimizer, loss_fn, device)
        last = epoch == config.epochs - 1
        if rank == 0 and (last or (epoch + 1) % config.checkpoint_every == 0):
            save_atomically(model.module.state_dict(), config.checkpoint_path)
        dist.barrier()  # nobody goes on while the checkpoint is being written

    trained = model.module
    cleanup_ddp()
    return trained
