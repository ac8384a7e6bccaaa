"""Exercise 25: every epoch sees the same data order, and the validation loss plateaus.

Bug report
----------
> After the first epoch the validation loss hardly moves. The training loss has the
> same saw-tooth shape in every epoch, and when I logged the first batch of each
> epoch it held the same samples every time. We call set_epoch at the start of every
> epoch, I checked (set_epoch below handles any sampler). The batches come from a
> BatchSampler because the real data set is bucketed by length; keep that.

What to do
----------
Find why the order never changes and fix the script. Afterwards every epoch draws
a new order of the training set on every rank, the ranks still split each epoch
between them (no sample on two ranks), and training is otherwise unchanged: keep
the model, the batch size, the learning rate and the BatchSampler.

Run it yourself (without --data it makes up a small data set):
    torchrun --nproc-per-node=2 exercises/debug/25_data_order.py
Grade it:  ddp-grade exercises/debug/25_data_order.py      (stuck? ddp-grade hint 25)

The grader runs main(argv) in 2 and in 3 processes as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) with --data, --out and --epochs,
reads which samples fed every step on every rank, and compares every rank's
model with a replay of the training in one process.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

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


def set_epoch(loader, epoch):
    """Reshuffle for the new epoch, whatever sampler the loader uses."""
    # With batch_sampler=, the loader's own .sampler is a SequentialSampler it made up and
    # never uses; the DistributedSampler that orders the data sits inside the batch sampler.
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default="runs/data_order")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)

    train_set, _ = load_data(args.data)
    batches = BatchSampler(DistributedSampler(train_set, shuffle=True), BATCH_SIZE, drop_last=False)
    loader = DataLoader(train_set, batch_sampler=batches)

    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    for epoch in range(args.epochs):
        set_epoch(loader, epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
