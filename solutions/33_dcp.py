"""Exercise 33: checkpoint an FSDP2 job with torch.distributed.checkpoint, asynchronously.

Exercise 09 checkpointed a DDP job: every rank held the whole model, so rank 0 wrote one
torch.save file. Under FSDP2 (exercise 31) no rank holds the whole model: each holds one
shard of every parameter (a DTensor), and the optimizer's state for that shard. Gathering it
all onto rank 0 costs the memory sharding saved. torch.distributed.checkpoint (DCP) instead
has every rank write its own shards, and rank 0 a `.metadata` index of which piece of which
tensor lies where, so that a job of another size can load the checkpoint: each of its ranks
reads the pieces its own shards need.

The grader starts the processes (RANK, LOCAL_RANK and WORLD_SIZE set, as torchrun sets them)
and the process group (gloo on CPU, NCCL on GPUs), builds `Model` (below) on every rank,
shards it with `shard_model` on a 1-D mesh of all the ranks, trains it with
torch.optim.AdamW, and calls your two functions:

    save(path, model, optimizer, step) -> None
        Called on every rank, with the same `path` (a folder) each time, after training step
        `step`; training goes on as soon as it returns. Save the model's and the optimizer's
        state and `step`.
        - Every rank writes its own shards: dcp with the sharded state dicts of
          get_state_dict (torch.distributed.checkpoint.state_dict). Never gather the whole
          model onto one rank.
        - Return once the state is copied, before it is written: dcp.async_save, so that the
          next training step runs while the files are written. Before starting a save, wait
          for the one before it (the future async_save returned: .result()).
        - The background save needs a process group of its own, made once:
          dist.new_group(backend="gloo"). Training uses the default group from the main
          thread; a second thread on it pairs its collectives with the wrong ones. (With NCCL,
          async_save needs a CPU group anyway.)
        - Write each save into a folder of its own under `path` (e.g. path/step-00000010): a
          job killed half-way through a save must leave the checkpoint before it whole.

    load(path, model, optimizer) -> int
        Called on every rank of a new job, which may have another number of ranks, with a
        freshly built and sharded model and a fresh optimizer. Load the newest complete
        checkpoint under `path` (DCP writes `.metadata` last: a folder without it is a save
        that never finished) into them with dcp.load and set_state_dict, and return its step.

The grader saves on 2 ranks and loads on 3 and on 4: the steps after a load must equal those of
the job that never stopped. It watches which rank writes which file, what each rank holds in
memory while saving and loading, when each checkpoint is complete (its disk is slow), and
kills a job half-way through a save.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/33_dcp.py      (stuck? ddp-grade hint 33)
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


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
