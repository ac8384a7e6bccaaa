"""Exercise 21: the job hangs at the first validation.

Bug report
----------
> Since I added validation the job hangs at the end of the first epoch. Epoch 0's
> training loss is printed, then nothing: no error, no validation loss, the
> processes sit there until the launcher's timeout kills them half an hour later.
> Same on 2 processes and on 3. The validation loss has to stay in the log, it is
> what we pick checkpoints by.

What to do
----------
Find why the job hangs and fix the script. Afterwards the job ends on every rank,
each epoch's line in the log holds the loss on the whole validation set, and the
training is the same as before: keep the model, the data, the batch size and the
learning rate.

Run it yourself (without --data it makes up a small data set):
    torchrun --nproc-per-node=2 exercises/debug/21_eval_hang.py
Grade it:  ddp-grade exercises/debug/21_eval_hang.py      (stuck? ddp-grade hint 21)

The grader runs main(argv) in 2 and in 3 processes as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) with --data, --out and --epochs,
and compares every rank's model with a replay of the training in one process.
A collective that waits 6 s for its peers counts as a hang.
"""

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

        if rank == 0:
            val_loss = evaluate(model, val_loader)
            print(f"epoch {epoch}: val loss {val_loss:.4f}")
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "val_loss": val_loss}) + "\n")
        dist.barrier()  # the other ranks wait here while rank 0 validates

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
