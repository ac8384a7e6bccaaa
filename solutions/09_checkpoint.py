"""Exercise 09: save and resume a distributed run.

A long job is stopped and restarted (a preemption, a crash, a time limit). The
restarted job must continue exactly where the first one stopped: same weights,
same optimizer state (momentum, Adam's averages and step count), next epoch.

The grader starts the processes (with RANK, LOCAL_RANK and WORLD_SIZE set, as
torchrun sets them) and the process group (gloo on CPU), and calls your two
functions inside it; do not call init_process_group yourself.

    save_checkpoint(model, optimizer, epoch: int, path: str) -> None
        `model` may be wrapped in DistributedDataParallel; `epoch` is the
        0-based index of the epoch just finished.
        - Rank 0 alone writes, with torch.save, the dict
              {"model": <the unwrapped model's state_dict>,
               "optimizer": optimizer.state_dict(),
               "epoch": epoch}
          The model's keys must not start with "module." (the DDP wrapper's
          prefix), so the file also loads into a plain model.
        - No rank returns before the file is complete: a rank that went on
          and read the file could find it half-written, or missing.

    load_checkpoint(model, optimizer, path: str) -> int
        Called on every rank, with a fresh model (wrapped in DDP or not) and a
        fresh optimizer built the same way as before.
        - Load the file with a map_location to this rank's own device (rank 0
          saved tensors of its device; without map_location they come back on
          that device, e.g. every rank on cuda:0).
        - Restore the model's and the optimizer's state.
        - Return the epoch to start from: the saved epoch + 1.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/09_checkpoint.py      (stuck? ddp-grade hint 09)
"""

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
    # The others wait here until rank 0 has finished writing.
    dist.barrier()


def load_checkpoint(model, optimizer, path: str) -> int:
    device = next(model.parameters()).device
    checkpoint = torch.load(path, map_location=device)
    unwrap(model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    # The saved epoch is finished: resume with the one after it.
    return checkpoint["epoch"] + 1
