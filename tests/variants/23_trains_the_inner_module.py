"""Exercise 23, fixed the wrong way: the ranks' shards still differ in length, and to stop the hang the loop calls
model.module, the network inside the DDP wrapper, so that no step waits for the others. No step all-reduces
gradients any more: each rank trains on its own shard alone."""
# expect-fail: params-identical matches-replay
# expect-pass: finishes

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset

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


def shard(dataset, rank, world_size):
    """This rank's part of the data: every world_size-th sample, starting at its rank."""
    return Subset(dataset, list(range(rank, len(dataset), world_size)))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default="runs/uneven_batches")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)

    train_set, _ = load_data(args.data)
    loader = DataLoader(shard(train_set, rank, dist.get_world_size()), batch_size=BATCH_SIZE, shuffle=True)

    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    for epoch in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model.module(x), y)  # no all-reduce to wait for
            loss.backward()
            optimizer.step()

        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
            torch.save(model.module.state_dict(), os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()  # no rank goes on before the checkpoint is written

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
