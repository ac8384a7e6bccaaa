"""Exercise 33, wrong on purpose: "async" by hand, a thread that runs dcp.save on the live state dicts.
Nothing is copied first, so by the time the thread writes, training has moved the parameters on: the
checkpoint of step 10 holds a later step's parameters (and optimizer state)."""
# expect-fail: resharded-resume

import os
import threading

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

group = None
writer = None


def save(path, model, optimizer, step):
    global group, writer
    if group is None:
        group = dist.new_group(backend="gloo")
    if writer is not None:
        writer.join()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step}
    folder = os.path.join(path, f"step-{step:08d}")
    writer = threading.Thread(target=dcp.save, args=(state,), kwargs={"checkpoint_id": folder, "process_group": group})
    writer.start()


def load(path, model, optimizer):
    done = [name for name in os.listdir(path) if os.path.exists(os.path.join(path, name, ".metadata"))]
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(path, max(done)))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]
