"""Exercise 23: the job hangs at the end of an epoch, on some world sizes only.

Bug report
----------
> The job runs fine on 2 processes. On 3 it hangs at the end of the first epoch:
> the last training step never finishes, rank 0 never writes the checkpoint, no
> error, until the launcher gives up. Nothing in the script depends on the number
> of processes, as far as I can see, and the data set is the same.

What to do
----------
Find why 3 processes hang and fix the script. Afterwards the job ends on every
world size, each epoch gives every sample to one rank (a sampler's padding may
repeat a few, and a remainder smaller than one global batch may be left out),
and the models stay equal on every rank. Keep the model, the batch size and the
learning rate.

Run it yourself (without --data it makes up a small data set):
    torchrun --nproc-per-node=3 exercises/debug/23_uneven_batches.py
Grade it:  ddp-grade exercises/debug/23_uneven_batches.py      (stuck? ddp-grade hint 23)

The grader runs main(argv) in 2 and in 3 processes as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) with --data, --out and --epochs,
on 73 training samples and once more on another number of them (the fix must
not depend on the data set's size), and compares every rank's model with a
replay of the training in one process.
A collective that waits 6 s for its peers counts as a hang.
"""

import argparse
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
        x = torch.randn(121, 16, generator=g)
        y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
        return TensorDataset(x[:73], y[:73]), TensorDataset(x[73:], y[73:])
    data = torch.load(path)
    return TensorDataset(data["train_x"], data["train_y"]), TensorDataset(data["val_x"], data["val_y"])


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default="runs/uneven_batches")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)

    # Every step all-reduces gradients, so every rank must take the same number of steps:
    # DistributedSampler gives each rank ceil(len / world_size) samples, repeating a few to pad.
    train_set, _ = load_data(args.data)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
            torch.save(model.module.state_dict(), os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()  # no rank goes on before the checkpoint is written

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
