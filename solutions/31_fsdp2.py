"""Exercise 31: shard a transformer with torch's FSDP2 (fully_shard), in mixed precision.

Exercise 11 built fully sharded data parallelism by hand. Production code uses
torch's own: `torch.distributed.fsdp.fully_shard`. Each call makes one unit: the
parameters of the module it is given (those not already in a unit) become
DTensors sharded on dim 0 over a DeviceMesh, are all-gathered in one collective
just before the module runs, freed after, and their gradients reduce-scattered
in one collective after backward. A `MixedPrecisionPolicy` says in which dtype
the gathered parameters compute and in which the gradients are reduced; the
sharded parameters, and so the optimizer, stay in float32.

The grader starts the processes (with RANK, LOCAL_RANK and WORLD_SIZE set, as
torchrun sets them) and the process group (gloo on CPU, NCCL on GPUs), builds the
same `Transformer` (below) on every rank, and trains it with your functions:

    mesh = init_device_mesh(device_type, (world_size,))
    model = shard_model(Transformer(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=...)
    for each step:
        loss = train_step(model, optimizer, (tokens, targets), max_norm)   # this rank's batch
    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module
        Apply fully_shard to each block of model.layers, then to model itself (the
        root: it takes what is left, tok_embeddings, norm and output), all with one
        MixedPrecisionPolicy that computes in bfloat16 and reduces gradients in
        float32. Return the model (fully_shard works in place).
    train_step(model, optimizer, batch, max_norm) -> float
        One training step on this rank's batch = (tokens, targets): the loss is
        loss_fn(model(tokens), targets) (below); backward; clip the gradients so
        that their norm over the whole model, every rank's shards together, is at
        most max_norm; optimizer step; leave no gradients behind for the next
        step. Return the loss as a Python float.

Every rank gets a different batch of the same size, so the average of the ranks'
gradients (what the reduce-scatter leaves in each shard) is the gradient of one
process training on all the batches at once. The grader replays that single
process in bfloat16 and compares every rank's shards after each step, watches
the collectives of each step (one all-gather per unit in forward, their dtypes,
the reduce-scatters' dtype), reads each parameter's placement, and checks the
full state dict above.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/31_fsdp2.py      (stuck? ddp-grade hint 31)
"""

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
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    # The gradients are DTensors: the norm is computed over every rank's shards.
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()
