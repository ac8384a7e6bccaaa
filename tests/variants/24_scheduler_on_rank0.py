"""Exercise 24, fixed the wrong way: the validation loss is all-reduced now, but only rank 0 steps the scheduler
(with the print, under `if rank == 0:`): rank 0 halves its learning rate, the other ranks never do, and their
weights drift apart."""
# expect-fail: params-identical lr-schedule
# expect-pass: finishes

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
    if path is None:  # a small made-up problem with noisy labels, enough to reproduce the report
        g = torch.Generator().manual_seed(0)
        x = torch.randn(144, 16, generator=g)
        y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
        noisy = torch.rand(144, generator=g) < 0.2
        y[noisy] = torch.randint(0, 4, (int(noisy.sum()),), generator=g)
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
    # Without this, each rank would see the loss of its own shard, and the scheduler
    # of each rank would cut the learning rate in its own epochs.
    dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[1]).item()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default="runs/rank_drift")
    parser.add_argument("--epochs", type=int, default=6)
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
    # Halve the learning rate as soon as an epoch improves the validation loss by less than 3%.
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0,
                                                           threshold=0.03)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

        val_loss = evaluate(model, val_loader)
        if rank == 0:
            scheduler.step(val_loss)
            print(f"epoch {epoch}: val loss {val_loss:.4f}, lr {optimizer.param_groups[0]['lr']:g}")
        torch.save(model.module.state_dict(), os.path.join(args.out, f"checkpoint-rank{rank}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
