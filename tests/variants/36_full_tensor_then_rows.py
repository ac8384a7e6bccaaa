"""Exercise 36, wrong on purpose: the source replica gathers each tensor whole (full_tensor) and sends the
wiped peer its rows of it: the right bytes arrive, but every source rank held the whole model for a moment."""
# expect-fail: holds-one-over-shards peer-messages
# expect-pass: recovered-bitwise
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


def recover_from_peer(model, optimizer, mesh, source_replica):
    replicas = mesh.get_group("replicate")
    me = mesh.get_local_rank("replicate")
    shards, shard = mesh.size(1), mesh.get_local_rank("shard")
    with torch.no_grad():
        for param in model.parameters():
            for value in [param] + [v for _, v in sorted(optimizer.state[param].items())]:
                local = value.to_local() if hasattr(value, "to_local") else value
                if me == source_replica:
                    whole = value.full_tensor() if hasattr(value, "full_tensor") else value
                    rows = whole.chunk(shards)[shard].contiguous() if whole.dim() else whole
                    for replica in range(replicas.size()):
                        if replica != source_replica:
                            dist.send(rows, dst=dist.get_global_rank(replicas, replica))
                else:
                    dist.recv(local, src=dist.get_global_rank(replicas, source_replica))
