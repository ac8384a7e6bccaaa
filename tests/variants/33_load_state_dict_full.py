"""Exercise 33, wrong on purpose: load reads the checkpoint into whole tensors (each parameter's
full_tensor()) and hands them to model.load_state_dict, as for an unsharded model. The FSDP2 model's
parameters are DTensors: the copy fails, and the optimizer is never restored."""
# expect-fail: resharded-resume whole-model

import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

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
    state = {"model": {name: p.full_tensor() for name, p in model.state_dict().items()}, "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(path, max(done)))
    model.load_state_dict(state["model"])
    return state["step"]
