"""Exercise 24 fixed without a collective: every rank scores the whole validation set itself (no
sampler on it), so every scheduler sees the same loss; checkpoints only from rank 0."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data")
    parser.add_argument("--out", default="runs")
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    data = torch.load(args.data)
    train_set = TensorDataset(data["train_x"], data["train_y"])
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=8, sampler=sampler)
    val_x, val_y = data["val_x"], data["val_y"]

    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = ReduceLROnPlateau(optimizer, "min", factor=0.5, patience=0, threshold=0.03)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            val_loss = F.cross_entropy(model.module(val_x), val_y).item()
        scheduler.step(val_loss)
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), os.path.join(args.out, "checkpoint.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
