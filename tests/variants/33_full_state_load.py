"""Exercise 33, wrong on purpose: saves right, but loads into full, unsharded state dicts
(full_state_dict=True) on every rank: DCP fills whole tensors from every rank's files, then
set_state_dict keeps each rank's part. It resumes, but every rank holds the whole model."""
# expect-fail: whole-model

import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

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
    done = [name for name in os.listdir(path) if os.path.exists(os.path.join(path, name, ".metadata"))]
    full = StateDictOptions(full_state_dict=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=full)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(path, max(done)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=full)
    return state["step"]
