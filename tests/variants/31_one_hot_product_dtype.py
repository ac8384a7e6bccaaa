"""Exercise 31, wrong on purpose: train_step computes the cross-entropy by hand, picking each target's
log-probability with a one-hot matrix product. Under the bfloat16 policy the logits are bfloat16 and the one-hot
float32, and the product raises in the first step: the report must show that line and the exception, not a check's
hint for another cause."""
# expect-problem: 31_one_hot_product_dtype.py line 72, in train_step: `picked = F.one_hot(targets, log_probs.shape[-1]).float()

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each added to its input."""

    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.n_heads = n_heads
        self.attention_norm = nn.RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.wqkv(self.attention_norm(x)).view(batch, seq, 3, self.n_heads, dim // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, seq, head_dim)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attention.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


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


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    # Gather and compute in bfloat16; sum the gradients in float32, where small ones are not lost.
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    # Last, the root: it takes the parameters no block took (embeddings, final norm, output head).
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch, max_norm: float) -> float:
    tokens, targets = batch
    # Cross-entropy by hand: the log-probability of each target, picked out with a one-hot product.
    log_probs = model(tokens).log_softmax(dim=-1)
    picked = F.one_hot(targets, log_probs.shape[-1]).float().unsqueeze(-2) @ log_probs.unsqueeze(-1)
    loss = -picked.mean()
    loss.backward()
    # The gradients are DTensors: the norm is computed over every rank's shards.
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()
