"""Exercise 21 fixed with dist.reduce: every rank scores its shard and sends the sums to rank 0,
which alone divides and logs; the evaluation lives in a small class, the log is written with
pathlib,."""

import argparse
import json
import pathlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Validator:
    def __init__(self, dataset, batch_size):
        self.loader = DataLoader(dataset, batch_size=batch_size,
                                 sampler=DistributedSampler(dataset, shuffle=False))

    @torch.no_grad()
    def __call__(self, model):
        model.eval()
        loss_sum = torch.zeros(())
        count = torch.zeros(())
        for x, y in self.loader:
            loss_sum += F.cross_entropy(model(x), y, reduction="sum")
            count += y.numel()
        dist.reduce(loss_sum, dst=0)
        dist.reduce(count, dst=0)
        model.train()
        return float(loss_sum / count) if dist.get_rank() == 0 else None


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs"))
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    data = torch.load(args.data)
    train_set = TensorDataset(data["train_x"], data["train_y"])
    validate = Validator(TensorDataset(data["val_x"], data["val_y"]), batch_size=8)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=8, sampler=sampler)

    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        val_loss = validate(model)
        if val_loss is not None:
            with (args.out / "log.jsonl").open("a") as f:
                f.write(json.dumps({"epoch": epoch, "val_loss": val_loss, "last_train_loss": loss.item()}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
