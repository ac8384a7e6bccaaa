"""Recovery as torchft's PGTransport moves a checkpoint: the model's and the optimizer's state dicts flattened
with torch's pytree in one order both replicas share, each leaf's local tensor sent as raw bytes (a uint8 view)
with a tag of its own by isend, received in place by irecv into the wiped rank's own state dict, every
transfer waited for at the end. A header of 8 bytes (the number of tensors) goes first so that a receiver
with another structure refuses instead of filling the wrong tensors."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten_with_path


def shard_hybrid(model, replicas, shards):
    mesh = init_device_mesh(next(model.parameters()).device.type, (replicas, shards),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def _leaves(model, optimizer):
    """The tensors of {model, optim} state dicts, in pytree order: each as the bytes of its local part."""
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()["state"]}
    leaves, _ = tree_flatten_with_path(state)
    out = []
    for _, value in leaves:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            out.append(local.view(-1).view(torch.uint8))  # the same memory, seen as bytes
    return out


def recover_from_peer(model, optimizer, mesh, source_replica):
    group = mesh.get_group("replicate")
    me = mesh.get_local_rank("replicate")
    with torch.no_grad():
        tensors = _leaves(model, optimizer)
        header = torch.tensor([len(tensors)], dtype=torch.int64)
        works = []
        if me == source_replica:
            for replica in range(group.size()):
                if replica == source_replica:
                    continue
                peer = dist.get_global_rank(group, replica)
                works.append(dist.isend(header, dst=peer, tag=1))
                works += [dist.isend(t, dst=peer, tag=2 + i) for i, t in enumerate(tensors)]
        else:
            source = dist.get_global_rank(group, source_replica)
            count = torch.zeros(1, dtype=torch.int64)
            dist.irecv(count, src=source, tag=1).wait()
            if int(count) != len(tensors):
                raise RuntimeError(f"the source sends {int(count)} tensors; this replica's state has {len(tensors)}")
            works = [dist.irecv(t, src=source, tag=2 + i) for i, t in enumerate(tensors)]
        for work in works:
            work.wait()
