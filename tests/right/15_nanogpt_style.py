"""main() in the style of nanoGPT's train.py: one if/else defines every name from the environment,
master_process gates the logging and the checkpoint, raw_model feeds it, and the snapshot goes
through tempfile.NamedTemporaryFile in the target folder, renamed over the path."""


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
    ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
    if ddp:
        ddp_rank = int(os.environ["RANK"])
        ddp_local_rank = int(os.environ["LOCAL_RANK"])
        ddp_world_size = int(os.environ["WORLD_SIZE"])
        gpus_for_me = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
        device = f"cuda:{ddp_local_rank}" if gpus_for_me else "cpu"
        if gpus_for_me:
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if gpus_for_me else "gloo")
        master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
    else:
        ddp_rank, ddp_local_rank, ddp_world_size = 0, 0, 1
        device = "cuda" if torch.cuda.is_available() else "cpu"
        master_process = True

    model = build_model().to(device)
    optimizer = build_optimizer(model)
    iter_num_epoch = 0
    if os.path.exists(args.snapshot):
        checkpoint = torch.load(args.snapshot, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_num_epoch = checkpoint["epoch"] + 1
        if master_process:
            print(f"resuming from {args.snapshot} at epoch {iter_num_epoch}")
    if ddp:
        model = DDP(model, device_ids=[ddp_local_rank] if device.startswith("cuda") else None)
    raw_model = model.module if ddp else model  # unwrap DDP container if needed

    dataset = build_dataset()
    sampler = DistributedSampler(dataset, num_replicas=ddp_world_size, rank=ddp_rank, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)

    for epoch in range(iter_num_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            logits = model(xb.to(device))
            loss = nn.functional.cross_entropy(logits, yb.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if master_process:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
            checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            folder = os.path.dirname(os.path.abspath(args.snapshot))
            with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as f:
                torch.save(checkpoint, f)
            os.replace(f.name, args.snapshot)

    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
