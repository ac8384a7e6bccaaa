"""Exercise 32, wrong on purpose: pytorch/examples' 2-D plan (fsdp_tp_example.py) keeps q, k and v as DTensors
(ColwiseParallel(use_local_output=False)), for a model whose attention reshapes them as plain tensors. The first
forward raises NotImplementedError inside torch's DTensor: a failure of this plan, not a stub left to write."""
# expect-problem: raised NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu

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
    "attention.wq": ColwiseParallel(use_local_output=False),
    "attention.wk": ColwiseParallel(use_local_output=False),
    "attention.wv": ColwiseParallel(use_local_output=False),
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
