"""train_ddp in the style of nanoGPT's train.py: module-level flags, raw_model, gradient clipping."""

import math
import os
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

grad_clip = 1.0  # clip gradients at this value, or disable if == 0.0
log_interval = 2


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=5))


def cleanup_ddp() -> None:
    if dist.is_initialized():
        destroy_process_group()


def train_ddp(rank: int, world_size: int, model_fn, dataset, epochs: int, batch_size: int, lr: float,
              checkpoint_path: str) -> torch.nn.Module:
    setup_ddp(rank, world_size)
    ddp_rank = dist.get_rank()
    ddp_world_size = dist.get_world_size()
    master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    device_type = "cuda" if "cuda" in device else "cpu"
    ctx = nullcontext() if device_type == "cpu" else torch.autocast(device_type=device_type, dtype=torch.float32)

    model = model_fn()
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
    model = DDP(model, device_ids=[torch.cuda.current_device()] if device_type == "cuda" else None)
    raw_model = model.module  # unwrap DDP container if needed

    sampler = DistributedSampler(dataset, num_replicas=ddp_world_size, rank=ddp_rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False)
    criterion = nn.CrossEntropyLoss()

    iter_num = 0
    t0 = time.time()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for X, Y in loader:
            X, Y = X.to(device), Y.to(device)
            with ctx:
                logits = model(X)
                loss = criterion(logits, Y)
            loss.backward()
            if grad_clip != 0.0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            t1 = time.time()
            dt, t0 = t1 - t0, t1
            if iter_num % log_interval == 0 and master_process:
                lossf = loss.item()
                print(f"iter {iter_num}: loss {lossf:.4f}, ppl {math.exp(min(lossf, 20)):.2f}, time {dt * 1000:.2f}ms")
            iter_num += 1

    if master_process:
        checkpoint = raw_model.state_dict()
        print(f"saving checkpoint to {checkpoint_path}")
        torch.save(checkpoint, checkpoint_path)
    dist.barrier()
    destroy_process_group()
    return raw_model
