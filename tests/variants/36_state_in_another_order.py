"""Exercise 36, wrong on purpose: the source sends each parameter's optimizer state by name (exp_avg,
exp_avg_sq, step), the wiped replica receives it in the order AdamW keeps it (step, exp_avg, exp_avg_sq):
the 2nd receive of a wiped rank (a step count, 4 bytes) meets the source's exp_avg, and gloo aborts the wiped
rank. The report names the two messages, not only gloo's words."""
# expect-fail: peer-messages
# expect-problem: gloo aborted rank

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


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer, by_name: bool) -> list[torch.Tensor]:
    """This rank's tensors of the training state: each parameter's local shard, then its optimizer
    state, by name or as the optimizer keeps it."""
    tensors = []
    for param in model.parameters():
        state = optimizer.state[param]
        for value in [param] + [state[k] for k in (sorted(state) if by_name else state)]:
            if isinstance(value, torch.Tensor):
                tensors.append(value.to_local() if hasattr(value, "to_local") else value)
    return tensors


def recover_from_peer(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                      source_replica: int) -> None:
    replicas = mesh.get_group("replicate")  # this shard's rank in every replica
    me = mesh.get_local_rank("replicate")
    source = dist.get_global_rank(replicas, source_replica)
    with torch.no_grad():
        # The source lists each parameter's state by name; the wiped replica as AdamW keeps it.
        for tensor in local_state(model, optimizer, by_name=me == source_replica):
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
