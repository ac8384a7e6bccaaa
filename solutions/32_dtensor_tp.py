"""Exercise 32: 2-D parallelism with DTensor: tensor parallelism inside each block, FSDP2 across.

Exercise 12 split an MLP over ranks by hand; exercise 31 sharded a whole model with fully_shard.
Large models are trained with both at once, on a 2-D DeviceMesh of shape (dp, tp). The tp ranks of
a row (the inner dimension: neighbouring ranks, the GPUs of one node) split every weight matrix and
compute each layer together, exchanging activations at every layer; the rows are data-parallel
groups, each training on its own batch, with the parameters sharded once more by fully_shard over
the column ("dp"), which exchanges parameters and gradients once per block and step.

torch writes tensor parallelism as a plan: a dict from submodule name to a style, applied with
torch.distributed.tensor.parallel.parallelize_module(module, tp_mesh, plan). Each style turns the
parameters of its module into DTensors on the "tp" mesh and converts the module's inputs and
outputs between layouts (placements):

    ColwiseParallel()     a Linear split by output features: weight Shard(0); input Replicate(), output
                          Shard(-1) (this rank's heads, or its part of the hidden units)
    RowwiseParallel()     a Linear split by input features: weight Shard(1); input Shard(-1), output the
                          partial sums reduced: Replicate() (all-reduce) or, with output_layouts=Shard(1),
                          scattered over the sequence (reduce-scatter)
    SequenceParallel()    a norm run on this rank's slice of the sequence: weight Replicate(), input
                          and output Shard(1)
    PrepareModuleInput(input_layouts=..., desired_input_layouts=...)
                          where a module's input changes layout (all-gather the sequence before it)

The model below has 31's dimensions. Its attention has separate wq, wk and wv (a fused wqkv split by
output features would give the first rank all of q and half of k), and it views its heads as -1:
under tensor parallelism each rank holds n_heads / tp of them.

The grader starts the processes (with RANK, LOCAL_RANK and WORLD_SIZE set, as torchrun sets them)
and the process group (gloo on CPU, NCCL on GPUs), builds the same `Transformer` on every rank, on
the device this rank uses, and trains it:

    model, mesh = parallelize(Transformer().to(device), world_size, tp_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=...)
    for each step:                                    # rank r gets the batch of group r // tp_size
        logits = model(tokens)
        loss = loss_fn(logits, targets)               # under loss_parallel() if logits is a DTensor
        loss.backward(); optimizer.step(); optimizer.zero_grad()

    parallelize(model: nn.Module, world_size: int, tp_size: int) -> tuple[nn.Module, DeviceMesh]
        1. The mesh: 2-D, for the device type the model is on, shape (world_size // tp_size,
           tp_size), dims named ("dp", "tp"). "tp" is the inner dimension: ranks
           g * tp_size ... g * tp_size + tp_size - 1 form tensor-parallel group g.
        2. Tensor parallelism over mesh["tp"] with parallelize_module, activations sharded over the
           sequence (dim 1) between the blocks:
             the root:    tok_embeddings RowwiseParallel(input_layouts=Replicate(),
                          output_layouts=Shard(1)); norm SequenceParallel(); output
                          ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()) (every
                          rank gets the whole logits), or Shard(-1) logits for loss_parallel.
             each block:  attention_norm and ffn_norm SequenceParallel(); attention and feed_forward
                          PrepareModuleInput from Shard(1) to Replicate(); attention.wq, .wk, .wv
                          and feed_forward.w1 ColwiseParallel(); attention.wo and feed_forward.w2
                          RowwiseParallel(output_layouts=Shard(1)).
        3. fully_shard each block over mesh["dp"], then the root. Tensor parallelism comes first:
           fully_shard shards the DTensors the plan made once more, on dim 0, over "dp".
        Return the model (both APIs change it in place) and the mesh.

The grader checks the mesh (shape, names, which ranks form each group); each linear's placements
(Shard(0) on "tp" for wq, wk, wv, w1 and the output head, Shard(1) for wo and w2) and every
parameter's Shard(0) on "dp"; that the norms' weights are replicated over "tp" and each norm runs
on this rank's 1/tp_size of the sequence; the process group of every collective (tensor-parallel
traffic inside "tp", FSDP's inside "dp"); and the first step's logits and the parameters after each
of three steps against the dense model trained in one process on every group's batch. World sizes
4 (dp 2 x tp 2) and 2 (dp 1 x tp 2).

Replace the `raise NotImplementedError` below; keep the name and signature.
Grade it with:  ddp-grade exercises/32_dtensor_tp.py      (stuck? ddp-grade hint 32)
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class Attention(nn.Module):
    """Causal self-attention with separate q, k and v projections."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads, not n_heads: under tensor parallelism this rank's wq returns its heads only.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (batch, heads, seq, head_dim)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """The MLP: w2(gelu(w1(x)))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then the MLP, each added to its input."""

    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token embeddings, a list of blocks, a final norm and the output head (no weight tying)."""

    def __init__(self, vocab: int = 96, dim: int = 32, n_layers: int = 3, n_heads: int = 4, hidden: int = 96):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, averaged over this rank's tokens, computed in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# Between the blocks the activations are sharded over the sequence (Shard(1)): each rank of a
# tensor-parallel group holds 1/tp of the tokens, and the norms run on those alone.
ROOT_PLAN = {
    # Each rank looks up the tokens in its rows of the vocabulary; the partial sums are reduce-scattered
    # over the sequence, which is the layout the first block expects.
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    # Gather the sequence, compute this rank's share of the vocabulary, gather the whole logits.
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}

BLOCK_PLAN = {
    "attention_norm": SequenceParallel(),
    # Attention needs every position: all-gather the sequence once, before wq, wk and wv.
    "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    # Reduce-scatter the partial sums back over the sequence, for the residual and the next norm.
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the root's and every block's layers over the tensor-parallel ranks."""
    parallelize_module(model, tp_mesh, ROOT_PLAN)
    for block in model.layers:
        parallelize_module(block, tp_mesh, BLOCK_PLAN)


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """Shard each block, then the root, over the data-parallel ranks."""
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def parallelize(model: nn.Module, world_size: int, tp_size: int) -> tuple[nn.Module, DeviceMesh]:
    device_type = next(model.parameters()).device.type
    # "tp" last: the inner dimension, so each tensor-parallel group is neighbouring ranks (one node).
    mesh = init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    # Tensor parallelism first: fully_shard then shards the DTensors it made, once more, over "dp".
    apply_tp(model, mesh["tp"])
    apply_fsdp(model, mesh["dp"])
    return model, mesh
