"""Exercise 33, wrong on purpose: every save goes into `path` itself. DCP overwrites the data files in
place and replaces .metadata last, so a save killed half-way leaves the old .metadata pointing into
truncated files: the checkpoint before it is lost."""
# expect-fail: survives-kill

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
    future = dcp.async_save(state, checkpoint_id=path, process_group=group)


def load(path, model, optimizer):
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]
