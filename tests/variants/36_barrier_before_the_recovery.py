"""Exercise 36, wrong on purpose: the recovery starts with a world dist.barrier(), "every replica ready
first": the state then moves point to point as it should, but a barrier is a collective, and a world barrier
stops every replica, the very thing a recovery from a live peer avoids."""
# expect-fail: peer-messages
# expect-not-checked: recovery-bytes
# expect-pass: mesh hybrid-placements block-units collective-groups holds-one-over-shards matches-single-process recovered-bitwise training-resumes
# expect-message: peer-messages a barrier is a collective

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
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


def shard_hybrid(model: nn.Module, replicas: int, shards: int) -> tuple[nn.Module, DeviceMesh]:
    device_type = next(model.parameters()).device.type
    # Dim 0 replicates, dim 1 shards: a replica is one row of the mesh, `shards` neighbouring ranks.
    mesh = init_device_mesh(device_type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's tensors of the training state, in an order every replica agrees on: each
    parameter's local shard, then its optimizer state (exp_avg, exp_avg_sq, step, by name)."""
    tensors = []
    for param in model.parameters():
        for value in [param] + [v for _, v in sorted(optimizer.state[param].items())]:
            if isinstance(value, torch.Tensor):
                tensors.append(value.to_local() if hasattr(value, "to_local") else value)
    return tensors


def recover_from_peer(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                      source_replica: int) -> None:
    dist.barrier()  # every replica ready (the wiped one restarted) before the state moves
    replicas = mesh.get_group("replicate")  # this shard's rank in every replica
    me = mesh.get_local_rank("replicate")
    source = dist.get_global_rank(replicas, source_replica)
    with torch.no_grad():
        for tensor in local_state(model, optimizer):
            # NCCL sends only GPU tensors; AdamW's step count lives on the CPU.
            wire = tensor if tensor.device.type == mesh.device_type else tensor.to(mesh.device_type)
            if me == source_replica:
                for replica in range(replicas.size()):
                    if replica != source_replica:
                        dist.send(wire, dst=dist.get_global_rank(replicas, replica))
            else:
                dist.recv(wire, src=source)  # in place: into this rank's own shard
                if wire is not tensor:
                    tensor.copy_(wire)
