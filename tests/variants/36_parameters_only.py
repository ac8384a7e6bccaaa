"""Exercise 36, wrong on purpose: only the parameters are sent; the wiped replica keeps AdamW's moments at zero
and its step count at 0."""
# expect-fail: recovered-bitwise training-resumes recovery-bytes
# expect-message: training-resumes the recovery left rank 0 with a state other than its source's

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
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local()
            if me == source_replica:
                for replica in range(replicas.size()):
                    if replica != source_replica:
                        dist.send(local, dst=dist.get_global_rank(replicas, replica))
            else:
                dist.recv(local, src=dist.get_global_rank(replicas, source_replica))
