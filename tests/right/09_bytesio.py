"""Checkpoints serialized into memory first and written with one call; read back the same way."""

import io
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _bare(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def save_checkpoint(model, optimizer, epoch: int, path: str) -> None:
    rank = dist.get_rank()
    if rank == 0:
        buffer = io.BytesIO()
        torch.save({"model": _bare(model).state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                   buffer)
        Path(path).write_bytes(buffer.getvalue())
        print(f"[rank {rank}] saved epoch {epoch} to {path} ({buffer.tell()} bytes)", flush=True)
    dist.barrier()


def load_checkpoint(model, optimizer, path: str) -> int:
    device = next(model.parameters()).device
    blob = io.BytesIO(Path(path).read_bytes())
    checkpoint = torch.load(blob, map_location=device)
    _bare(model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint["epoch"] + 1
