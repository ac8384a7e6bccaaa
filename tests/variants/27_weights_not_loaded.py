"""Exercise 27, fixed the wrong way: every rank reads the checkpoint and takes its optimizer state and epoch, but
the weights are never loaded: the resumed job goes on from the freshly built model."""
# expect-fail: resumed

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
MOMENTUM = 0.9


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


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default="runs/resume")
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train in this run")
    parser.add_argument("--resume", default=None, help="a checkpoint.pt to continue from")
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)

    train_set, _ = load_data(args.data)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    start_epoch = 0
    if args.resume:
        # DDP copied rank 0's weights to the others when it was built, and never again: every
        # rank reads the checkpoint itself, the optimizer's momentum and the epoch included.
        checkpoint = torch.load(args.resume, map_location="cpu")
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1

    for epoch in range(start_epoch, start_epoch + args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        print(f"rank {rank}, epoch {epoch}: loss {loss.item():.4f}")
        if rank == 0:
            checkpoint = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(checkpoint, os.path.join(args.out, "checkpoint.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
