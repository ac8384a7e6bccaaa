"""train_ddp that counts epochs from 1 (set_epoch(1), set_epoch(2), ...) and writes its checkpoint
through an in-memory buffer: serialize first, then write the bytes in one go."""

import io
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


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


def to_bytes(state_dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()


def train_ddp(rank: int, world_size: int, model_fn, dataset, epochs: int, batch_size: int, lr: float,
              checkpoint_path: str) -> torch.nn.Module:
    setup_ddp(rank, world_size)
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if dist.get_backend() == "nccl" else torch.device("cpu")
    net = model_fn().to(device)
    ddp_net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)

    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(ddp_net.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()

    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        for batch_index, (x, y) in enumerate(loader, start=1):
            optimizer.zero_grad()
            loss = criterion(ddp_net(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch}/{epochs}: last loss {loss.item():.4f} after {batch_index} steps")

    if rank == 0:
        Path(checkpoint_path).write_bytes(to_bytes(net.state_dict()))
    cleanup_ddp()
    return net
