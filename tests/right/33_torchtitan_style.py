"""Exercise 33, right, the way torchtitan's checkpointer does it: the model and the optimizer in a
Stateful AppState (DCP calls its state_dict() when saving and its load_state_dict() when loading), the
training step in a Stateful of its own, async saves on a gloo group made at start, the previous save
waited for first. Each save is written into a hidden .tmp-step-N folder, which rank 0 renames to
step-N once the save is done: load only ever sees complete checkpoints."""

import os

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class AppState(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optimizer_state}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


class TrainState(Stateful):
    def __init__(self, step=0):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state_dict):
        self.step = state_dict["step"]


class CheckpointManager:
    def __init__(self):
        self.pg = None
        self.async_future = None

    def _folder(self, path, step, tmp=False):
        return os.path.join(path, f"{'.tmp-' if tmp else ''}step-{step}")

    def save(self, path, model, optimizer, step):
        if self.pg is None:
            self.pg = dist.new_group(backend="gloo")
        if self.async_future is not None:
            self.async_future.result()
        states = {"app": AppState(model, optimizer), "train_state": TrainState(step)}
        tmp, final = self._folder(path, step, tmp=True), self._folder(path, step)
        self.async_future = dcp.async_save(states, checkpoint_id=tmp, process_group=self.pg)
        if dist.get_rank() == 0:
            def publish(future):  # every rank's files and the .metadata are written once the future is done
                if future.exception() is None:
                    os.rename(tmp, final)
            self.async_future.add_done_callback(publish)

    def load(self, path, model, optimizer):
        steps = [int(name.split("-")[1]) for name in os.listdir(path) if name.startswith("step-")]
        train_state = TrainState()
        dcp.load({"app": AppState(model, optimizer), "train_state": train_state},
                 checkpoint_id=self._folder(path, max(steps)))
        return train_state.step


manager = CheckpointManager()


def save(path, model, optimizer, step):
    manager.save(path, model, optimizer, step)


def load(path, model, optimizer) -> int:
    return manager.load(path, model, optimizer)
