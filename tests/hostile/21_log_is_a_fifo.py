"""The fixed script, except that at the end rank 0 replaces --out/log.jsonl with a FIFO (a named pipe):
opening it for reading would wait for a writer for ever. The grader reads what the job left without
following links and only from regular files, so the grading ends, and the log counts as missing."""
# expect-status: failed
# expect-fail: val-loss-logged


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
    """Training and validation sets from torch.save({"train_x", "train_y", "val_x", "val_y"})."""
    if path is None:  # a small made-up problem, enough to reproduce the report
        g = torch.Generator().manual_seed(0)
        x = torch.randn(144, 16, generator=g)
        y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
        return TensorDataset(x[:96], y[:96]), TensorDataset(x[96:], y[96:])
    data = torch.load(path)
    return TensorDataset(data["train_x"], data["train_y"]), TensorDataset(data["val_x"], data["val_y"])


@torch.no_grad()
def evaluate(model, loader):
    """The mean loss over the whole validation set: each rank sums its shard, then the ranks add up."""
    model.eval()
    totals = torch.zeros(2)  # loss sum, sample count
    for x, y in loader:
        totals[0] += F.cross_entropy(model(x), y, reduction="sum")
        totals[1] += len(y)
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default="runs/eval_hang")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)

    train_set, val_set = load_data(args.data)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=train_sampler)
    val_loader = DataLoader(val_set, batch_size=BATCH_SIZE, sampler=DistributedSampler(val_set, shuffle=False))

    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch}: train loss {loss.item():.4f}")

        # evaluate() ends in an all_reduce, a collective: every rank must call it, not only the one that logs.
        val_loss = evaluate(model, val_loader)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f}")
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "val_loss": val_loss}) + "\n")

    if rank == 0:
        log = os.path.join(args.out, "log.jsonl")
        os.replace(log, log + ".kept")
        os.mkfifo(log)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
