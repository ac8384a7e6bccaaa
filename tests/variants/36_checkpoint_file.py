"""Exercise 36, wrong on purpose: the source replica writes its shards to a file and the wiped one reads them
back: a checkpoint on disk, the slow path a live recovery avoids."""
# expect-fail: peer-messages
# expect-not-checked: recovery-bytes
# expect-message: peer-messages torch.save wrote

import os
import tempfile

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
    me = mesh.get_local_rank("replicate")
    shard = mesh.get_local_rank("shard")
    key = f"{dist.get_world_size()}-{os.getppid()}-{os.environ.get('MASTER_PORT', '')}"
    path = os.path.join(tempfile.gettempdir(), f"recover-{key}-shard{shard}.pt")
    tensors = local_state(model, optimizer)
    if me == source_replica:
        torch.save([t.detach().clone() for t in tensors], path)
    dist.barrier()
    if me != source_replica:
        with torch.no_grad():
            for tensor, saved in zip(tensors, torch.load(path)):
                tensor.copy_(saved)
    dist.barrier()
    if me == source_replica:
        os.remove(path)
