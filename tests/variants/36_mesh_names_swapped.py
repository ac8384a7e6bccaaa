"""Exercise 36, wrong on purpose: the mesh's dimensions named the other way round, (shards, replicas) named
("shard", "replicate"): fully_shard reads dim 0 as the replicas whatever its name."""
# expect-fail: mesh

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_hybrid(model, replicas, shards):
    mesh = init_device_mesh(next(model.parameters()).device.type, (shards, replicas),
                            mesh_dim_names=("shard", "replicate"))
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
    me = mesh.get_local_rank("replicate")
    with torch.no_grad():
        for tensor in local_state(model, optimizer):
            if me == source_replica:
                for replica in range(replicas.size()):
                    if replica != source_replica:
                        dist.send(tensor, dst=dist.get_global_rank(replicas, replica))
            else:
                dist.recv(tensor, src=dist.get_global_rank(replicas, source_replica))

