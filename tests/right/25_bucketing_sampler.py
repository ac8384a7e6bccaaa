"""Exercise 25 fixed in a small bucketing batch sampler of the script's own: it wraps a
DistributedSampler, forwards set_epoch to it, and groups its indices into batches; the loader
has two workers and the epoch loop uses enumerate and a progress print."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class DistributedBatches(Sampler):
    def __init__(self, dataset, batch_size):
        self.sampler = DistributedSampler(dataset, shuffle=True)
        self.batch_size = batch_size

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        indices = list(self.sampler)
        for start in range(0, len(indices), self.batch_size):
            yield indices[start:start + self.batch_size]

    def __len__(self):
        return -(-len(self.sampler) // self.batch_size)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    data = torch.load(args.data)
    train_set = TensorDataset(data["train_x"], data["train_y"])
    batches = DistributedBatches(train_set, batch_size=8)
    loader = DataLoader(train_set, batch_sampler=batches, num_workers=2)
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        loader.batch_sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if dist.get_rank() == 0 and step % 4 == 0:
                print(f"epoch {epoch} step {step}/{len(loader)} loss {loss.item():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
