"""Exercise 36, wrong on purpose: each parameter's shard, its exp_avg and its step count travel, the three
AdamW tensors as remembered; exp_avg_sq, the second moment, stays zero on the wiped replica, whose next updates
divide by the square root of one step's squared gradient instead of the running one."""
# expect-fail: recovered-bitwise training-resumes recovery-bytes
# expect-pass: mesh hybrid-placements block-units collective-groups holds-one-over-shards matches-single-process peer-messages
# expect-message: recovered-bitwise the optimizer's exp_avg_sq of
# expect-message: training-resumes the optimizer's exp_avg_sq of

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
    source = dist.get_global_rank(replicas, source_replica)
    with torch.no_grad():
        for param in model.parameters():
            state = optimizer.state[param]
            for value in (param, state["exp_avg"], state["step"]):
                local = value.to_local() if hasattr(value, "to_local") else value
                if me == source_replica:
                    for replica in range(replicas.size()):
                        if replica != source_replica:
                            dist.send(local, dst=dist.get_global_rank(replicas, replica))
                else:
                    dist.recv(local, src=source)
