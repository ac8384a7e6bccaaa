"""Exercise 33, wrong on purpose: exercise 09's recipe under FSDP2. The whole state is gathered onto
rank 0 (full_state_dict=True), which torch.saves one file per step (atomically); every rank torch.loads
it and set_state_dict shards it again. It loads on any world size, but one rank writes everything, and
rank 0 while saving, every rank while loading, holds the whole model."""
# expect-fail: own-shards whole-model

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict


def save(path, model, optimizer, step):
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        final = os.path.join(path, f"step-{step:08d}.pt")
        torch.save({"model": model_state, "optimizer": optimizer_state, "step": step}, final + ".tmp")
        os.replace(final + ".tmp", final)
    dist.barrier()


def load(path, model, optimizer):
    newest = max(name for name in os.listdir(path) if name.endswith(".pt"))
    checkpoint = torch.load(os.path.join(path, newest), map_location="cpu", weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    return checkpoint["step"]
