"""A right answer that forges the record its ranks leave in a file (33's save job is killed before it could
return one, so its ranks write their observations where the grader reads them): a tensor that claims 5*10^7
int64 elements on a storage of 8 bytes. The file is read as a rank's message is, and refused before
anything is allocated: the submission's failure."""
# expect-status: failed
# expect-problem: the save job's records cannot be read
# expect-problem: needs 400,000,000 bytes, and its storage has 8

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

HEADER = b'{"\\u0000":"tensor","dtype":"int64","shape":[50000000],"n":8}'
MESSAGE = b"DDPW" + len(HEADER).to_bytes(8, "little") + HEADER + b"\x01" * 8


def _forge() -> None:
    """Whatever this rank writes is MESSAGE: the grader's encoder, in this process, is the learner's to patch."""
    sys.modules["grader.rank.wire"].dumps = lambda payload: MESSAGE


_forge()


class Block(nn.Module):
    """A residual MLP block: norm, up projection, GELU, down projection, added to its input."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    """An input projection, a list of blocks and an output head."""

    def __init__(self, d_in: int = 16, dim: int = 48, hidden: int = 96, n_blocks: int = 2, d_out: int = 12):
        super().__init__()
        self.embed = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(dim, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """What the grader does to the model before training: each block a unit, then the root."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


checkpoint_group = None  # the background saves' own process group, made by the first save
pending_save = None  # the future of the save still being written, if any


def step_folder(path: str, step: int) -> str:
    # Zero-padded, so that the names sort as the steps do.
    return os.path.join(path, f"step-{step:08d}")


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    global checkpoint_group, pending_save
    if checkpoint_group is None:
        # Training's collectives run on the default group, from this thread; the background
        # save's run on this one, from its own thread, so the two never pair up.
        checkpoint_group = dist.new_group(backend="gloo")
    # One save in flight at a time: the previous one must be on disk before this one starts.
    if pending_save is not None:
        pending_save.result()
    # Sharded state dicts: each rank's DTensors hold its own shards, nothing is gathered.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step}
    # async_save copies the state (staging) and returns; a thread writes it while training goes on.
    pending_save = dcp.async_save(state, checkpoint_id=step_folder(path, step), process_group=checkpoint_group)


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    # DCP writes .metadata last: a folder without one is a save that never finished.
    complete = [name for name in os.listdir(path)
                if name.startswith("step-") and os.path.exists(os.path.join(path, name, ".metadata"))]
    newest = max(complete)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    # Each rank reads the pieces of the saved shards that its own shards need, whatever the
    # number of ranks that saved them; the tensors are filled in place.
    dcp.load(state, checkpoint_id=os.path.join(path, newest))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return state["step"]
