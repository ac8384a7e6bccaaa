"""Exercise 24 fixed with all_gather_object: each rank sends its shard's (loss sum, count) as
plain numbers, and every rank adds them up the same way before the scheduler step."""

import argparse

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


@torch.no_grad()
def shard_loss(model, loader):
    model.eval()
    total, count = 0.0, 0
    for x, y in loader:
        total += F.cross_entropy(model(x), y, reduction="sum").item()
        count += len(y)
    model.train()
    return total, count


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    data = torch.load(args.data)
    train_set = TensorDataset(data["train_x"], data["train_y"])
    val_set = TensorDataset(data["val_x"], data["val_y"])
    sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=16, sampler=DistributedSampler(val_set, shuffle=False))

    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.03)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        parts = [None] * world_size
        dist.all_gather_object(parts, shard_loss(model, val_loader))
        val_loss = sum(t for t, _ in parts) / sum(c for _, c in parts)
        scheduler.step(val_loss)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
