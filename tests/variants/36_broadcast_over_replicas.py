"""Exercise 36, wrong on purpose: each tensor broadcast from the source over the replicas' group: the state
arrives, but every replica takes part in a collective (with more replicas, each healthy one receives it too)."""
# expect-fail: peer-messages
# expect-pass: recovered-bitwise training-resumes holds-one-over-shards
# expect-not-checked: recovery-bytes

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_hybrid(model, replicas, shards):
    mesh = init_device_mesh(next(model.parameters()).device.type, (replicas, shards),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def local_state(model, optimizer):
    tensors = []
    for param in model.parameters():
        for value in [param] + [v for _, v in sorted(optimizer.state[param].items())]:
            tensors.append(value.to_local() if hasattr(value, "to_local") else value)
    return tensors


def recover_from_peer(model, optimizer, mesh, source_replica):
    replicas = mesh.get_group("replicate")
    with torch.no_grad():
        for tensor in local_state(model, optimizer):
            dist.broadcast(tensor, group=replicas, group_src=source_replica)
