"""Exercise 26, fixed the wrong way: the accumulating micro-batches are meant to run inside no_sync(), but it is asked
of model.module, the network inside the DDP wrapper; no_sync is the wrapper's method, and the first micro-batch
raises AttributeError on every rank."""
# expect-fail: finishes

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH_SIZE = 4  # per micro-batch
ACCUM_STEPS = 4  # micro-batches per optimizer step
LR = 0.1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(path):
    """Training and validation sets from torch.save({"train_x", "train_y", "val_x", "val_y"})."""
    if path is None:  # a small made-up problem, enough to reproduce the report
        g = torch.Generator().manual_seed(0)
        x = torch.randn(144, 16, generator=g)
        y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
        return TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])
    data = torch.load(path)
    return TensorDataset(data["train_x"], data["train_y"]), TensorDataset(data["val_x"], data["val_y"])


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default="runs/accum_sync")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)

    train_set, _ = load_data(args.data)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        optimizer.zero_grad()
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % ACCUM_STEPS == 0
            # DDP decides in the forward whether the coming backward all-reduces: the forward
            # of a micro-batch that only accumulates belongs inside no_sync() too.
            with contextlib.nullcontext() if last else model.module.no_sync():
                loss = F.cross_entropy(model(x), y) / ACCUM_STEPS
                loss.backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item() * ACCUM_STEPS:.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
