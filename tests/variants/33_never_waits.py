"""Exercise 33, wrong on purpose: every save starts a dcp.async_save and drops its future; nothing waits
for the save before it. On a slow disk two saves are in flight at once, on one group from two threads."""
# expect-fail: waits-previous

import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

group = None


def save(path, model, optimizer, step):
    global group
    if group is None:
        group = dist.new_group(backend="gloo")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step}
    dcp.async_save(state, checkpoint_id=os.path.join(path, f"step-{step:08d}"), process_group=group)


def load(path, model, optimizer):
    done = [name for name in os.listdir(path) if os.path.exists(os.path.join(path, name, ".metadata"))]
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(path, max(done)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]
