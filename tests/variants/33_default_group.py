"""Exercise 33, wrong on purpose: dcp.async_save without a process group of its own. Its thread runs the
save's collectives on the default group while the main thread's training step runs its own there: the
ranks pair them up differently (gloo aborts with a size mismatch, or the job hangs; NCCL refuses it)."""
# expect-fail: own-group

import os

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

future = None


def save(path, model, optimizer, step):
    global future
    if future is not None:
        future.result()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step}
    future = dcp.async_save(state, checkpoint_id=os.path.join(path, f"step-{step:08d}"))


def load(path, model, optimizer):
    done = [name for name in os.listdir(path) if os.path.exists(os.path.join(path, name, ".metadata"))]
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(path, max(done)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]
