"""Exercise 27 fixed with one reader: rank 0 reads the checkpoint file and hands the whole of it
(weights, optimizer state, epoch) to the other ranks with broadcast_object_list; every rank then
loads it. Ranks from the environment, nanoGPT style, and checkpoints written atomically."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data")
    parser.add_argument("--out", default="out")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--resume")
    args = parser.parse_args(argv)

    ddp_rank = int(os.environ["RANK"])
    master_process = ddp_rank == 0
    dist.init_process_group(backend="gloo")
    if master_process:
        os.makedirs(args.out, exist_ok=True)

    data = torch.load(args.data)
    train_set = TensorDataset(data["train_x"], data["train_y"])
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=8, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(Net())
    raw_model = model.module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    start_epoch = 0
    if args.resume:
        box = [torch.load(args.resume, map_location="cpu") if master_process else None]
        dist.broadcast_object_list(box, src=0)
        checkpoint = box[0]
        raw_model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"] + 1

    for epoch in range(start_epoch, start_epoch + args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if master_process:
            path = os.path.join(args.out, "checkpoint.pt")
            torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                       path + ".tmp")
            os.replace(path + ".tmp", path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
