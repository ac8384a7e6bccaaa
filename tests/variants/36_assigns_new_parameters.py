"""Exercise 36, wrong on purpose: each shard received into a new tensor, and the parameters loaded with
load_state_dict(assign=True): the modules now show the right values, but they are new Parameters, not those
FSDP gathers and AdamW steps, so training goes on from the wiped values."""
# expect-fail: training-resumes
# expect-pass: recovered-bitwise recovery-bytes peer-messages

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


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
    received = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if me == source_replica:
                for replica in range(replicas.size()):
                    if replica != source_replica:
                        dist.send(param.to_local(), dst=dist.get_global_rank(replicas, replica))
            else:
                local = torch.empty_like(param.to_local())
                dist.recv(local, src=source)
                received[name] = torch.nn.Parameter(DTensor.from_local(local, param.device_mesh, param.placements))
            for _, value in sorted(optimizer.state[param].items()):
                local = value.to_local() if isinstance(value, DTensor) else value
                if me == source_replica:
                    for replica in range(replicas.size()):
                        if replica != source_replica:
                            dist.send(local, dst=dist.get_global_rank(replicas, replica))
                else:
                    dist.recv(local, src=source)
    if received:
        model.load_state_dict(received, assign=True)
