"""Exercise 33, wrong on purpose: a folder per save, but load takes the newest folder whether or not its
save finished. After a job killed half-way through a save, that folder has no .metadata."""
# expect-fail: survives-kill

import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

group = None
future = None


def save(path, model, optimizer, step):
    global group, future
    if group is None:
        group = dist.new_group(backend="gloo")
    if future is not None:
        future.result()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step}
    future = dcp.async_save(state, checkpoint_id=os.path.join(path, f"step-{step:08d}"), process_group=group)


def load(path, model, optimizer):
    newest = max(name for name in os.listdir(path) if name.startswith("step-"))
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(path, newest))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]
