"""Exercise 36: hybrid sharding (HSDP) with FSDP2, and a wiped replica recovered from a live peer.

Exercise 31 sharded a model over every rank. At thousands of GPUs every layer's all-gather and
reduce-scatter then spans the whole job, over the slow links between nodes, with a latency that
grows with the number of ranks. Hybrid sharding splits the ranks into
`replicas` groups of `shards` neighbouring ranks (one node, say). Inside a replica the model is
fully sharded, each rank holding 1 / shards of every parameter; the replicas hold the same
model, so the gradient of a step is reduce-scattered inside each replica, then all-reduced
across the replicas, between the ranks that hold the same shard. FSDP2 does this when
fully_shard is given a 2-D DeviceMesh: dim 0 replicates, dim 1 shards, and each parameter
becomes a DTensor placed (Replicate(), Shard(0)).

Replicas also make a failure cheap. When one replica dies, torchft (PyTorch's fault-tolerance
library) does not reload a checkpoint: the replaced replica fetches the state, at the current
step, from a replica that kept training. Each shard rank of the new replica receives its own
shard from the same shard rank of a healthy replica, by point-to-point messages
(torchft/checkpointing/pg_transport.py: each DTensor's local tensor, never gathered), and
training goes on as if nothing happened.

    shard_hybrid(model, replicas, shards) -> (model, mesh)
        Build a 2-D DeviceMesh of shape (replicas, shards) named ("replicate", "shard"), on the
        device type of the model's parameters: "shard" is the inner dimension, so replica r is
        ranks r * shards ... r * shards + shards - 1. Apply fully_shard on that mesh to each
        block of model.blocks, then to model itself (the root takes what is left: embed and head).
        Return the model (fully_shard works in place) and the mesh.

    recover_from_peer(model, optimizer, mesh, source_replica) -> None
        Called on every rank, right after the grader wiped the state of every replica but
        `source_replica` (as a replica restarted on new machines: its parameters freshly
        initialised, its AdamW state allocated but zero, as torchtitan's torchft integration
        allocates it before it heals). Make every replica's parameters and optimizer state
        equal the source replica's, bit for bit, decided as torchft's PGTransport decides:
        - the rank of shard s of a wiped replica receives from the rank of shard s of the source
          replica (the ranks mesh["replicate"] groups together), by point-to-point messages
          (send/recv or isend/irecv). No collective, not even a barrier: a broadcast over the
          replicas would stop every replica and send each healthy one what it already has, and
          a barrier stops them all as well. No file. (torchft's
          quorum picks a source for each shard rank, taking the healthy replicas in turn; here
          the grader names one source replica for every shard.)
        - what travels is each DTensor's local tensor (to_local()): every parameter's shard and
          its AdamW moments (exp_avg, exp_avg_sq), received in place into the wiped rank's own
          tensors, and the step count: each parameter's step tensor, or one step number for
          all of them (AdamW steps every parameter together, so their counts are equal; the
          wiped rank then fills each of its step tensors with it). Nothing is gathered whole,
          on either side.
        - unlike PGTransport, send no pickled description of the state first: both replicas
          built the same model and optimizer, so the receiver already knows every name, shape
          and dtype (a length or a step number, at most 1 KiB besides the tensors, is allowed).
        On GPUs (NCCL) AdamW keeps its step counts on the CPU: send them through the GPU.

The grader starts the ranks and the process group (gloo on CPU), builds `Model` (below) in
float64 on 4 ranks (2 replicas x 2 shards) and in float32 on 2 (2 x 1), calls shard_hybrid,
trains with torch.optim.AdamW on a different batch on every rank, and compares with one process
training on all the batches. Then it wipes one replica and calls recover_from_peer. It records
the process group of every collective, what each rank holds in memory (keep no copy of the
model or of its state beside the shards), every message the recovery sends and its bytes, and
whether the next steps end bit for bit where the steps of the same job without the failure end.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/36_hybrid_recovery.py      (stuck? ddp-grade hint 36)
"""

import torch
import torch.distributed as dist  # noqa: F401  (what you will use)
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: F401
from torch.distributed.fsdp import fully_shard  # noqa: F401


class Block(nn.Module):
    """A residual MLP block: norm, up projection, GELU, down projection, added to its input."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    """An input projection, a list of blocks and an output head."""

    def __init__(self, d_in: int = 16, dim: int = 48, hidden: int = 96, n_blocks: int = 2, d_out: int = 12):
        super().__init__()
        self.embed = nn.Linear(d_in, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(dim, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def shard_hybrid(model: nn.Module, replicas: int, shards: int) -> tuple[nn.Module, DeviceMesh]:
    # TODO: a 2-D mesh (replicas, shards) named ("replicate", "shard") on the parameters' device type;
    # fully_shard each block of model.blocks, then the model, on it; return (model, mesh).
    raise NotImplementedError


def recover_from_peer(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                      source_replica: int) -> None:
    # TODO: on the source replica, send each parameter's local shard and its AdamW state (exp_avg,
    # exp_avg_sq, step) to the rank of the same shard in every other replica; there, receive each
    # one in place into the rank's own tensors. Point to point only, in the same order on both sides.
    raise NotImplementedError
