"""Exercise 33, wrong on purpose: dcp.async_save, then .result() on its future before returning "to be
safe": as blocking as dcp.save, with a thread on top."""
# expect-fail: async-save

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
    future = dcp.async_save(state, checkpoint_id=os.path.join(path, f"step-{step:08d}"), process_group=group)
    future.result()


def load(path, model, optimizer):
    done = [name for name in os.listdir(path) if os.path.exists(os.path.join(path, name, ".metadata"))]
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(path, max(done)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]
