"""Exercise 33, wrong on purpose: only the model is checkpointed. The loaded job starts AdamW afresh
(no averages, step 0), so its next steps differ from the job that never stopped."""
# expect-fail: optimizer-state resharded-resume

import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

group = None
future = None


def save(path, model, optimizer, step):
    global group, future
    if group is None:
        group = dist.new_group(backend="gloo")
    if future is not None:
        future.result()
    state = {"model": get_model_state_dict(model), "step": step}
    future = dcp.async_save(state, checkpoint_id=os.path.join(path, f"step-{step:08d}"), process_group=group)


def load(path, model, optimizer):
    done = [name for name in os.listdir(path) if os.path.exists(os.path.join(path, name, ".metadata"))]
    state = {"model": get_model_state_dict(model), "step": 0}
    dcp.load(state, checkpoint_id=os.path.join(path, max(done)))
    set_model_state_dict(model, state["model"])
    return state["step"]
