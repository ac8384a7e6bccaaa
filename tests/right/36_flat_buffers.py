"""Hybrid sharding with the mesh built from its rank layout (DeviceMesh, ranks read from the environment), the
root kept gathered between forward and backward as FSDP2 keeps it; recovery packs a rank's whole local state
into one flat buffer per dtype and moves it with batch_isend_irecv inside the replicas' group (group_peer), the
receiver unpacking it into its own tensors."""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def shard_hybrid(model, replicas, shards):
    world = int(os.environ["WORLD_SIZE"])
    assert world == replicas * shards, f"{replicas} x {shards} replicas and shards for {world} ranks"
    layout = torch.arange(world).view(replicas, shards)  # row r: the ranks of replica r
    mesh = DeviceMesh(next(model.parameters()).device.type, layout, mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model, mesh


def _by_dtype(model, optimizer):
    groups = {}
    for p in model.parameters():
        for t in [p, *(optimizer.state[p][k] for k in ("exp_avg", "exp_avg_sq", "step"))]:
            local = t.to_local() if hasattr(t, "to_local") else t
            groups.setdefault(local.dtype, []).append(local)
    return groups


def recover_from_peer(model, optimizer, mesh, source_replica):
    group = mesh.get_group("replicate")
    mine = group.rank()
    with torch.no_grad():
        for dtype, tensors in sorted(_by_dtype(model, optimizer).items(), key=lambda item: str(item[0])):
            if mine == source_replica:
                flat = torch.cat([t.reshape(-1) for t in tensors])
                ops = [dist.P2POp(dist.isend, flat, group=group, group_peer=r)
                       for r in range(group.size()) if r != source_replica]
            else:
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype)
                ops = [dist.P2POp(dist.irecv, flat, group=group, group_peer=source_replica)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if mine != source_replica:
                for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(part.view_as(t))
