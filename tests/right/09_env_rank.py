"""Checkpoints for a job started by torchrun: the rank from RANK, the device from LOCAL_RANK."""

import os

import torch
import torch.distributed as dist


def _rank() -> int:
    return int(os.environ["RANK"])


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def save_checkpoint(model, optimizer, epoch, path):
    if _rank() == 0:
        unwrapped = model.module if hasattr(model, "module") else model
        torch.save({"model": unwrapped.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)
    dist.barrier()


def load_checkpoint(model, optimizer, path):
    checkpoint = torch.load(path, map_location=_device())
    unwrapped = model.module if hasattr(model, "module") else model
    unwrapped.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint["epoch"] + 1
