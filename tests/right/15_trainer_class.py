"""main() as in PyTorch's multinode DDP tutorial: a Trainer class with _load_snapshot and
_save_snapshot, global_rank from RANK and local_rank from LOCAL_RANK; the snapshot is serialized
into memory and written to a temporary file that is fsynced and renamed over the path."""


import argparse
import io
import os

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


class Trainer:
    def __init__(self, model, train_data, optimizer, snapshot_path: str) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["model"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        self.epochs_run = snapshot["epoch"] + 1
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = nn.CrossEntropyLoss()(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source.to(self.device), targets.to(self.device))

    def _save_snapshot(self, epoch):
        snapshot = {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "epoch": epoch}
        buffer = io.BytesIO()
        torch.save(snapshot, buffer)
        tmp = f"{self.snapshot_path}.partial"
        with open(tmp, "wb") as f:
            f.write(buffer.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0:
                self._save_snapshot(epoch)


def ddp_setup():
    dist.init_process_group(backend="gloo")


def main() -> None:
    args = parse_args()
    ddp_setup()
    dataset = build_dataset()
    train_data = DataLoader(dataset, batch_size=BATCH_SIZE, pin_memory=False, shuffle=False,
                            sampler=DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]),
                                                       rank=int(os.environ["RANK"]), seed=SEED))
    model = build_model()
    optimizer = build_optimizer(model)
    trainer = Trainer(model, train_data, optimizer, args.snapshot)
    trainer.train(EPOCHS)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
