"""Exercise 33, wrong on purpose: the step is not saved; load returns AdamW's own step count instead.
That counts the optimizer's steps since this job began, not the training step the job was at."""
# expect-fail: returns-step

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
    future = dcp.async_save({"model": model_state, "optimizer": optimizer_state},
                            checkpoint_id=os.path.join(path, f"step-{step:08d}"), process_group=group)


def load(path, model, optimizer):
    done = [name for name in os.listdir(path) if os.path.exists(os.path.join(path, name, ".metadata"))]
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=os.path.join(path, max(done)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    first = next(iter(optimizer.state.values()))
    return int(first["step"])
