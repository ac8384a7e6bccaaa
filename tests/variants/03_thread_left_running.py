"""Exercise 03, broken: a progress thread (not a daemon) keeps running after train_ddp returns,
so under torchrun the rank never exits."""
# expect-fail: process-can-exit

import os
import threading
import time
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


def _report_progress(state: dict) -> None:
    while True:  # until the process ends: it never does, since this thread is not a daemon
        time.sleep(0.5)
        print(f"[rank {state['rank']}] step {state['step']}", flush=True)


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
    state = {"rank": rank, "step": 0}
    threading.Thread(target=_report_progress, args=(state,), name="progress-reporter").start()

    for epoch in range(epochs):
        # The shuffle is seeded with seed + epoch: without this, every epoch repeats epoch 0's order.
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(x), y)
            loss.backward()  # gradients are averaged across ranks during this call
            optimizer.step()
            state["step"] += 1

    # Every rank holds the same weights: one writer is enough, and two would race.
    if rank == 0:
        torch.save(ddp_model.module.state_dict(), checkpoint_path)

    cleanup_ddp()
    return ddp_model.module
