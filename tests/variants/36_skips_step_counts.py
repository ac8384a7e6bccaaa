"""Exercise 36, wrong on purpose: only the sharded tensors travel (dim() > 0); AdamW's step counts, plain scalars,
stay 0 on the wiped replica, and its bias correction starts over."""
# expect-fail: recovered-bitwise training-resumes recovery-bytes
# expect-message: recovered-bitwise the optimizer's step of
# expect-message: training-resumes the optimizer's step of
# expect-message: recovery-bytes and no step count

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
            for value in [param] + [v for _, v in sorted(optimizer.state[param].items()) if v.dim() > 0]:
                local = value.to_local()
                if me == source_replica:
                    for replica in range(replicas.size()):
                        if replica != source_replica:
                            dist.send(local, dst=dist.get_global_rank(replicas, replica))
                else:
                    dist.recv(local, src=dist.get_global_rank(replicas, source_replica))
