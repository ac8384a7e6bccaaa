"""Checkpoints written atomically (a NamedTemporaryFile in the same folder, then os.replace) and
loaded with weights_only; the model unwrapped with getattr."""

import os
import tempfile

import torch
import torch.distributed as dist


def save_checkpoint(model, optimizer, epoch, path):
    if dist.get_rank() == 0:
        state = {
            "model": getattr(model, "module", model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
        }
        directory = os.path.dirname(os.path.abspath(path))
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".ckpt-", delete=False) as tmp:
            torch.save(state, tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp.name, path)
    dist.barrier()


def load_checkpoint(model, optimizer, path):
    state = torch.load(path, map_location="cpu", weights_only=True)
    getattr(model, "module", model).load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    return int(state["epoch"]) + 1
