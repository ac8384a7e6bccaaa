"""Exercise 33, wrong on purpose: dcp.save, which returns only once every rank's files and the
.metadata are written. Correct checkpoints, but training stops for the disk at every save."""
# expect-fail: async-save

import os

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save(path, model, optimizer, step):
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step}
    dcp.save(state, checkpoint_id=os.path.join(path, f"step-{step:08d}"))


def load(path, model, optimizer):
    done = [name for name in os.listdir(path) if os.path.exists(os.path.join(path, name, ".metadata"))]
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(path, max(done)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]
