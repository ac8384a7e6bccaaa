"""Exercise 09, wrong on purpose: the barrier is inside `if rank == 0`, so only rank 0 waits, for ever."""
# expect-fail: barrier-after-save

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper, or the model itself."""
    return model.module if isinstance(model, DDP) else model


def save_checkpoint(model, optimizer, epoch: int, path: str) -> None:
    # Every rank holds the same weights, so one writer is enough; several
    # writers to one file can leave it corrupt.
    if dist.get_rank() == 0:
        checkpoint = {
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
        }
        torch.save(checkpoint, path)
        dist.barrier()


def load_checkpoint(model, optimizer, path: str) -> int:
    device = next(model.parameters()).device
    checkpoint = torch.load(path, map_location=device)
    unwrap(model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    # The saved epoch is finished: resume with the one after it.
    return checkpoint["epoch"] + 1
