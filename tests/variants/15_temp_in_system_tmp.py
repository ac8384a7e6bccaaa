"""Exercise 15, broken: writes each snapshot to a temporary file from tempfile.mkstemp() (in the system's temporary
folder) and os.replace's it onto the path. On one machine that works; on a cluster the snapshot lives on shared
storage and /tmp on each node's own disk, and os.replace across file systems fails with EXDEV."""
# expect-fail: snapshot-atomic

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 4
BATCH_SIZE = 4
NUM_SAMPLES = 48
LR = 0.05
MOMENTUM = 0.9
SEED = 15


def build_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def build_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = torch.randint(0, 4, (NUM_SAMPLES,), generator=g)
    return TensorDataset(x, y)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fault-tolerant DDP training under torchrun.")
    parser.add_argument("--snapshot", default="snapshot.pt", help="where to save and resume the snapshot")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])

    # One GPU per worker of this node, or the CPU for all of them.
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")

    model = build_model().to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = build_optimizer(ddp_model)

    # After a restart, or when the whole job is launched again, main() starts from the top:
    # continue from the snapshot whenever it exists, whatever the restart count says.
    start_epoch = 0
    if os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot, map_location=device)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        start_epoch = snapshot["epoch"] + 1

    dataset = build_dataset()
    # The global rank: LOCAL_RANK restarts at 0 on every node.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(start_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(x), y)
            loss.backward()
            optimizer.step()

        if rank == 0:
            snapshot = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            # A kill between these two lines leaves the previous snapshot as it was.
            fd, tmp_path = tempfile.mkstemp(suffix=".pt")
            with os.fdopen(fd, "wb") as f:
                torch.save(snapshot, f)
            os.replace(tmp_path, args.snapshot)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
