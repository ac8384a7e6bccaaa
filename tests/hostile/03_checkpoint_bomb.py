"""A right answer whose rank 0 then swaps its checkpoint's pickle for 41 bytes that call
bytearray(3_380_000_000): torch.load(weights_only=True) alone would run it (bytearray is on its allowlist)
and allocate 3.38 GB in the grader. The grader reads a checkpoint's pickle before torch.load does and
refuses the global: the checkpoint checks fail, nothing is allocated."""
# expect-status: failed
# expect-fail: checkpoint-no-module-prefix
# expect-fail: checkpoint-loads
# expect-problem: names builtins.bytearray, which no state dict needs

import io
import os
import pickle
import zipfile
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
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(x), y)
            loss.backward()  # gradients are averaged across ranks during this call
            optimizer.step()

    # Every rank holds the same weights: one writer is enough, and two would race.
    if rank == 0:
        torch.save(ddp_model.module.state_dict(), checkpoint_path)
        swap_pickle(checkpoint_path)

    cleanup_ddp()
    return ddp_model.module


class Bomb:
    def __reduce__(self):
        return bytearray, (3_380_000_000,)


def swap_pickle(path: str) -> None:
    """The same zip, its data.pkl a pickle that asks for 3.38 GB."""
    with zipfile.ZipFile(path) as saved:
        records = {r.filename: saved.read(r) for r in saved.infolist()}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as swapped:
        for name, data in records.items():
            swapped.writestr(name, pickle.dumps(Bomb(), protocol=2) if name.endswith("/data.pkl") else data)
    with open(path, "wb") as f:
        f.write(out.getvalue())
