"""Exercise 09, broken: rank 0 saves into a folder that does not exist, so save_checkpoint raises there
(and the other ranks wait at the barrier for it)."""
# expect-problem: save_checkpoint raised

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
        torch.save(checkpoint, path + ".d/checkpoint.pt")  # into a folder nobody made
    # The others wait here until rank 0 has finished writing.
    dist.barrier()


def load_checkpoint(model, optimizer, path: str) -> int:
    device = next(model.parameters()).device
    checkpoint = torch.load(path, map_location=device)
    unwrap(model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    # The saved epoch is finished: resume with the one after it.
    return checkpoint["epoch"] + 1
