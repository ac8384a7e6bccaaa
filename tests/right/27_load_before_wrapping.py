"""Exercise 27 fixed by restoring before wrapping: every rank builds the model, loads the
checkpoint's weights into it, wraps it in DDP, builds the optimizer and loads its state; the
training loop is a function of its own that logs each epoch's mean loss."""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def restore(path):
    """(model state, optimizer state, first epoch to train) or (None, None, 0) for a fresh start."""
    if not path:
        return None, None, 0
    checkpoint = torch.load(path, map_location=lambda storage, location: storage)
    return checkpoint["model"], checkpoint["optimizer"], checkpoint["epoch"] + 1


def train_epoch(model, optimizer, loader):
    total, batches = 0.0, 0
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total, batches = total + loss.item(), batches + 1
    return total / max(batches, 1)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--resume")
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = torch.load(args.data)
    train_set = TensorDataset(data["train_x"], data["train_y"])
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=8, sampler=sampler)

    model_state, optimizer_state, start_epoch = restore(args.resume)
    torch.manual_seed(0)
    net = Net()
    if model_state is not None:
        net.load_state_dict(model_state)
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)

    for epoch in range(start_epoch, start_epoch + args.epochs):
        sampler.set_epoch(epoch)
        mean_loss = train_epoch(model, optimizer, loader)
        if rank == 0:
            with open(os.path.join(args.out, "log.jsonl"), "a") as log:
                log.write(json.dumps({"epoch": epoch, "loss": mean_loss}) + "\n")
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
