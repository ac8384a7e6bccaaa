"""Exercise 21 fixed another way: rank 0 validates alone, on the unwrapped model and the whole
validation set, with no collective inside; every rank meets at the barrier afterwards."""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH_SIZE = 8
LR = 0.1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(path):
    data = torch.load(path)
    return TensorDataset(data["train_x"], data["train_y"]), TensorDataset(data["val_x"], data["val_y"])


@torch.no_grad()
def evaluate_locally(model, dataset):
    """Rank 0 alone: the plain module, the whole set, no collective."""
    model.eval()
    total, count = 0.0, 0
    for x, y in DataLoader(dataset, batch_size=16):
        total += F.cross_entropy(model(x), y, reduction="sum").item()
        count += len(y)
    model.train()
    return total / count


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="runs")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group(backend="gloo")
    rank = int(os.environ["RANK"])
    train_set, val_set = load_data(args.data)
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler)

    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    log_path = os.path.join(args.out, "log.jsonl")

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        if rank == 0:
            val = evaluate_locally(ddp.module, val_set)
            with open(log_path, "a", encoding="utf-8") as f:
                print(json.dumps({"epoch": epoch, "val_loss": val, "lr": LR}), file=f)
        dist.barrier()

    dist.destroy_process_group()
