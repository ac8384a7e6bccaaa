"""Recovery that sends one step number for every parameter: AdamW steps all its parameters together, so their
step counts are equal, and the source sends the first one once, at the end, as a plain int64 number (as a
training loop's own step counter would travel); the wiped replica fills each of its step tensors with it.
Everything else goes tensor by tensor in its own dtype, the moments keyed by name, with blocking send/recv on
the replicas' group (group_dst / group_src: ranks in the group). The mesh from init_device_mesh."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def shard_hybrid(model, replicas, shards):
    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh), mesh


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def recover_from_peer(model, optimizer, mesh, source_replica):
    group = mesh.get_group("replicate")
    me = group.rank()
    device = torch.device(mesh.device_type)
    params = list(model.parameters())
    tensors = []
    for p in params:
        tensors.append(_local(p))
        tensors += [_local(optimizer.state[p][name]) for name in ("exp_avg", "exp_avg_sq")]
    if me == source_replica:
        step = torch.tensor([int(optimizer.state[params[0]]["step"])], dtype=torch.int64, device=device)
        for peer in range(group.size()):
            if peer == source_replica:
                continue
            for t in tensors:
                dist.send(t, group=group, group_dst=peer)
            dist.send(step, group=group, group_dst=peer)
    else:
        for t in tensors:
            dist.recv(t, group=group, group_src=source_replica)
        step = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(step, group=group, group_src=source_replica)
        for p in params:
            optimizer.state[p]["step"].fill_(int(step))
