"""Exercise 36, wrong on purpose: plain FSDP over every rank (a 1-D mesh of the whole world), the 2-D mesh made
only to be returned: every layer's gathers and reductions run over the whole job."""
# expect-fail: hybrid-placements collective-groups

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_hybrid(model, replicas, shards):
    device_type = next(model.parameters()).device.type
    everyone = init_device_mesh(device_type, (replicas * shards,))
    for block in model.blocks:
        fully_shard(block, mesh=everyone)
    fully_shard(model, mesh=everyone)
    return model, init_device_mesh(device_type, (replicas, shards), mesh_dim_names=("replicate", "shard"))


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

