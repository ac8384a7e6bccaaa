"""Exercise 33, right: a small Checkpointer object with explicit storage: a FileSystemWriter for each
save (one folder per step, named by the step alone), a FileSystemReader for each load, and the step
kept as a tensor in a "meta" entry. A folder counts as a checkpoint when its metadata can be read."""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


class Checkpointer:
    def __init__(self):
        self.group = None  # made at the first save, by every rank together
        self.in_flight = None

    def save(self, path, model, optimizer, step):
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        if self.in_flight is not None:
            self.in_flight.result()
            self.in_flight = None
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "meta": {"step": torch.tensor(step)}}
        writer = FileSystemWriter(os.path.join(path, f"{step:09d}"), sync_files=True, thread_count=1)
        self.in_flight = dcp.async_save(state, storage_writer=writer, process_group=self.group)

    def load(self, path, model, optimizer):
        for name in sorted(os.listdir(path), key=lambda n: int(n) if n.isdigit() else -1, reverse=True):
            reader = FileSystemReader(os.path.join(path, name))
            try:
                reader.read_metadata()
            except (FileNotFoundError, EOFError):
                continue  # a save that never finished
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state, "meta": {"step": torch.tensor(-1)}}
            dcp.load(state, storage_reader=reader)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            return int(state["meta"]["step"])
        raise FileNotFoundError(f"no complete checkpoint under {path}")


checkpointer = Checkpointer()


def save(path, model, optimizer, step):
    checkpointer.save(path, model, optimizer, step)


def load(path, model, optimizer) -> int:
    return checkpointer.load(path, model, optimizer)
