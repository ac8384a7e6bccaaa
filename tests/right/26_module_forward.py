"""Exercise 26 fixed by going around the wrapper: the micro-batches that only accumulate run
through model.module (plain autograd, no DDP hooks armed), and the last one through the DDP
wrapper, whose backward all-reduces the accumulated .grad once."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

ACCUM_STEPS = 4


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
    parser.add_argument("--out")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    data = torch.load(args.data)
    train_set = TensorDataset(data["train_x"], data["train_y"])
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=4, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            syncing = (i + 1) % ACCUM_STEPS == 0
            forward = model if syncing else model.module
            (F.cross_entropy(forward(x), y) / ACCUM_STEPS).backward()
            if syncing:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
