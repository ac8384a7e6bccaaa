"""Exercise 36, wrong on purpose: the source pickles its model and optimizer state dicts (torch.save into memory)
and sends the bytes: right values, but the pickle's description of every tensor travels with them."""
# expect-fail: recovery-bytes
# expect-pass: recovered-bitwise training-resumes peer-messages

import io

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
    replicas = mesh.get_group("replicate")
    me = mesh.get_local_rank("replicate")
    if me == source_replica:
        buffer = io.BytesIO()
        torch.save([t.detach() for t in local_state(model, optimizer)], buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        for replica in range(replicas.size()):
            if replica != source_replica:
                peer = dist.get_global_rank(replicas, replica)
                dist.send(torch.tensor([payload.numel()]), dst=peer)
                dist.send(payload, dst=peer)
    else:
        source = dist.get_global_rank(replicas, source_replica)
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, src=source)
        payload = torch.empty(int(length), dtype=torch.uint8)
        dist.recv(payload, src=source)
        received = torch.load(io.BytesIO(payload.numpy().tobytes()))
        with torch.no_grad():
            for tensor, value in zip(local_state(model, optimizer), received):
                tensor.copy_(value)
