"""Exercise 22 fixed with a vector of loss weights: the losses are stacked and weighted by
(1, 0) in the warm-up and (1, AUX_WEIGHT) afterwards, so aux_head is in every graph; the
rank comes from the environment and the loop is a small Trainer class."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

AUX_WEIGHT = 0.3
WARMUP_EPOCHS = 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.aux_head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.training:
            return self.head(h), self.aux_head(h)
        return self.head(h)


class Trainer:
    def __init__(self, dataset, batch_size=8, lr=0.1):
        self.sampler = DistributedSampler(dataset)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler)
        torch.manual_seed(0)
        self.model = DDP(Net())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)

    def loss_weights(self, epoch):
        return torch.tensor([1.0, AUX_WEIGHT if epoch >= WARMUP_EPOCHS else 0.0])

    def run_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        weights = self.loss_weights(epoch)
        for x, y in self.loader:
            self.optimizer.zero_grad(set_to_none=True)
            outputs = self.model(x)
            losses = torch.stack([F.cross_entropy(o, y) for o in outputs])
            (losses @ weights).backward()
            self.optimizer.step()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", default="runs")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    data = torch.load(args.data)
    trainer = Trainer(TensorDataset(data["train_x"], data["train_y"]))
    for epoch in range(args.epochs):
        trainer.run_epoch(epoch)
        if int(os.environ.get("RANK", "0")) == 0:
            print("epoch", epoch, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
