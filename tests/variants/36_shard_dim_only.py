"""Exercise 36, wrong on purpose: fully_shard given mesh["shard"], the replica's own ranks: each replica is
sharded, but the replicas never average their gradients and drift apart."""
# expect-fail: hybrid-placements collective-groups matches-single-process

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_hybrid(model, replicas, shards):
    mesh = init_device_mesh(next(model.parameters()).device.type, (replicas, shards),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
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

