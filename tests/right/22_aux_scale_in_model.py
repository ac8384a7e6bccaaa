"""Exercise 22 fixed with a schedule of auxiliary-loss scales built up front (0 in the warm-up)
and a criterion that always includes the auxiliary term, so DDP sees a gradient for aux_head
every time; the optimizer's defaults are spelled out."""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH_SIZE = 8
LR = 0.1
AUX_WEIGHT = 0.3
WARMUP_EPOCHS = 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.aux_head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.training:
            return self.head(h), self.aux_head(h)
        return self.head(h)


def criterion(outputs, y, aux_scale):
    logits, aux_logits = outputs
    return F.cross_entropy(logits, y) + aux_scale * F.cross_entropy(aux_logits, y)


def main(argv=None):
    parser = argparse.ArgumentParser(description="train with an auxiliary head")
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group(backend="gloo")
    blob = torch.load(args.data, weights_only=True)
    dataset = TensorDataset(blob["train_x"], blob["train_y"])
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler, num_workers=0)

    torch.manual_seed(0)
    model = DistributedDataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)

    schedule = {epoch: (0.0 if epoch < WARMUP_EPOCHS else AUX_WEIGHT) for epoch in range(args.epochs)}
    for epoch, aux_scale in schedule.items():
        sampler.set_epoch(epoch)
        for batch in loader:
            x, y = batch
            loss = criterion(model(x), y, aux_scale)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
