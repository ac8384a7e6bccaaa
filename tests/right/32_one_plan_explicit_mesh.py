"""Exercise 32, right: the mesh built from an explicit rank layout (DeviceMesh over a (dp, tp) grid of
ranks), one plan for the whole model applied once with wildcard names, and fully_shard over the
"dp" column of that mesh."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
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



SEQUENCE = Shard(1)  # the layout of the activations between the blocks

PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=SEQUENCE),
    "layers.*.attention_norm": SequenceParallel(),
    "layers.*.attention": PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),)),
    "layers.*.attention.w[qkv]": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(output_layouts=SEQUENCE),
    "layers.*.ffn_norm": SequenceParallel(),
    "layers.*.feed_forward": PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),)),
    "layers.*.feed_forward.w1": ColwiseParallel(),
    "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=SEQUENCE),
    "norm": SequenceParallel(),
    "output": ColwiseParallel(input_layouts=SEQUENCE, output_layouts=Replicate()),
}


def parallelize(model: nn.Module, world_size: int, tp_size: int) -> tuple[nn.Module, DeviceMesh]:
    assert world_size % tp_size == 0, f"tp_size {tp_size} does not divide world_size {world_size}"
    # Row g of the grid is tensor-parallel group g: ranks g*tp ... g*tp + tp - 1.
    grid = torch.arange(world_size).reshape(world_size // tp_size, tp_size)
    mesh = DeviceMesh(next(model.parameters()).device.type, grid, mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], PLAN)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh
