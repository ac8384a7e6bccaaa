"""train_ddp with the logging module, an evaluation pass over the training data after every epoch
(under no_grad, in eval mode, accuracy summed over the ranks) and an averaged loss in the log."""

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

logger = logging.getLogger("train")


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


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    correct = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct[0] += (model(x).argmax(dim=1) == y).sum()
        correct[1] += len(y)
    dist.all_reduce(correct)
    model.train()
    return (correct[0] / correct[1]).item()


def train_ddp(rank: int, world_size: int, model_fn, dataset, epochs: int, batch_size: int, lr: float,
              checkpoint_path: str) -> torch.nn.Module:
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s")
    setup_ddp(rank, world_size)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    model = DDP(model_fn().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()
    logger.info("%d samples, %d steps per epoch", len(dataset), len(loader))

    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        running = torch.zeros((), device=device)
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            running += loss.detach()
        dist.all_reduce(running, op=dist.ReduceOp.SUM)
        accuracy = evaluate(model, loader, device)
        if rank == 0:
            logger.info("epoch %d: mean loss %.4f, train accuracy %.3f", epoch,
                        running.item() / (world_size * len(loader)), accuracy)

    if rank == 0:
        torch.save(model.module.state_dict(), checkpoint_path)
        logger.info("saved %s", checkpoint_path)
    cleanup_ddp()
    return model.module
