"""Exercise 26 fixed with the micro-batches of a step gathered first: itertools.batched-style
chunks of ACCUM_STEPS, every micro-batch but the last inside an ExitStack that enters no_sync(),
and the loss scaled by the chunk's length."""

import argparse
from contextlib import ExitStack

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

BATCH_SIZE = 4
ACCUM_STEPS = 4
LR = 0.1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def chunks(loader, size):
    chunk = []
    for batch in loader:
        chunk.append(batch)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data")
    parser.add_argument("--out")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    data = torch.load(args.data)
    train_set = TensorDataset(data["train_x"], data["train_y"])
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for micro_batches in chunks(loader, ACCUM_STEPS):
            for k, (x, y) in enumerate(micro_batches):
                with ExitStack() as stack:
                    if k < len(micro_batches) - 1:
                        stack.enter_context(model.no_sync())
                    loss = F.cross_entropy(model(x), y) / len(micro_batches)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
