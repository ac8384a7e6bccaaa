"""train_ddp that reads LOCAL_RANK from the environment (as under torchrun), asks the group for its rank,
uses DataLoader worker processes and draws a small progress bar from len(loader)."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class Progress:
    """A minimal progress bar, for rank 0 only."""

    def __init__(self, iterable, desc: str, enabled: bool, width: int = 20):
        self.iterable, self.desc, self.enabled, self.width = iterable, desc, enabled, width
        self.total = len(iterable)

    def __iter__(self):
        for done, item in enumerate(self.iterable, start=1):
            yield item
            if self.enabled:
                filled = self.width * done // self.total
                sys.stdout.write(f"\r{self.desc} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total}")
                sys.stdout.flush()
        if self.enabled:
            sys.stdout.write("\n")


def train_ddp(rank: int, world_size: int, model_fn, dataset, epochs: int, batch_size: int, lr: float,
              checkpoint_path: str) -> torch.nn.Module:
    setup_ddp(rank, world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}") if on_gpu else torch.device("cpu")

    model = DistributedDataParallel(model_fn().to(device), device_ids=[device.index] if on_gpu else None)
    sampler = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=2,
                        persistent_workers=True, pin_memory=on_gpu)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()

    is_main = dist.get_rank() == 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        for inputs, labels in Progress(loader, f"epoch {epoch + 1}/{epochs}", enabled=is_main):
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(inputs), labels).backward()
            optimizer.step()

    if is_main:
        torch.save(model.module.state_dict(), checkpoint_path)
    cleanup_ddp()
    return model.module
