"""Exercise 36, wrong on purpose: the replicas laid out as the inner dimension ("so that a node that fails takes
one shard of each replica"): a replica is then ranks far apart, and every layer's gathers cross the nodes."""
# expect-fail: mesh collective-groups

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import DeviceMesh


def shard_hybrid(model, replicas, shards):
    device_type = next(model.parameters()).device.type
    ranks = torch.arange(replicas * shards).reshape(shards, replicas).t()  # replica r: ranks r, r + replicas, ...
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("replicate", "shard"))
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

