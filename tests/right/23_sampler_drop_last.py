"""Exercise 23 fixed with drop_last twice: DistributedSampler(drop_last=True) deals out equal shards
(the remainder of the data set left out), the DataLoader drops each rank's short last batch, and
the sampler's rank and world size come from torchrun's environment."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
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
    # Both remainders dropped: the sampler cuts the data set to a multiple of the world size (every
    # rank gets len // world_size samples), and the loader drops each rank's last, short batch. The
    # ranks' shards are equal, so their batches are too.
    sampler = DistributedSampler(train_set, num_replicas=int(os.environ["WORLD_SIZE"]),
                                 rank=int(os.environ["RANK"]), shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler, drop_last=True)

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
