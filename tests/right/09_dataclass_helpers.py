"""Checkpoints through a small dataclass, with an is_main_process helper, extra metadata in the
file and the barrier in a finally block."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class Checkpoint:
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    epoch: int
    world_size: int = 1
    saved_at: float = field(default_factory=time.time)


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, path: str) -> None:
    try:
        if is_main_process():
            checkpoint = Checkpoint(model=unwrap(model).state_dict(), optimizer=optimizer.state_dict(),
                                    epoch=epoch, world_size=dist.get_world_size())
            torch.save(asdict(checkpoint), path)
    finally:
        if dist.is_initialized():
            dist.barrier()


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> int:
    device = next(iter(model.parameters())).device
    raw = torch.load(path, map_location=device, weights_only=True)
    checkpoint = Checkpoint(**raw)
    unwrap(model).load_state_dict(checkpoint.model)
    optimizer.load_state_dict(checkpoint.optimizer)
    return checkpoint.epoch + 1
