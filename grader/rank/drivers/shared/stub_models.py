"""The models the grader builds itself from a stub's or a script's own code, one copy of each, kept here so
that a learner's file cannot change them. ``tests/test_stub_models.py`` holds every copy to the file it
comes from: the same parameters, the same initial values from the same seed, the same output and loss.

* :class:`TwoLayerNet` (the debugging track's scripts 21 and 23-27) and :class:`TwoHeadNet` (22's);
* :class:`JobNet` (28 and 29's FSDP2 scripts);
* :class:`Transformer` (31's with :class:`FusedBlock`, 32's with :class:`Block`) and :func:`lm_loss`;
* :class:`MLPModel` (33's and 36's);
* :class:`PipelineModel` (34's) and :func:`pipeline_loss`.

Two copies live elsewhere, held to their files by the same test: 15's model in its ``rank.py`` (which torchrun
runs as a script, importing nothing of the grader), and 41-43's transformer, the kit's cost model written out
for a rank (:mod:`.capacity_model`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# --- the debugging track: 21-27 ----------------------------------------------------------------------------


class TwoLayerNet(nn.Module):
    """Every script of 21-27 but 22's: 16 features in, 32 hidden, 4 classes."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class TwoHeadNet(nn.Module):
    """22's script: a second head (an auxiliary loss) on the same hidden layer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.aux_head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.head(h), self.aux_head(h)


# --- the debugging track: 28 and 29 (FSDP2) ---------------------------------------------------------------

JOB_VOCAB, JOB_DIM, JOB_HIDDEN, JOB_LAYERS = 256, 32, 64, 2


class JobBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(JOB_DIM)
        self.fc1 = nn.Linear(JOB_DIM, JOB_HIDDEN)
        self.fc2 = nn.Linear(JOB_HIDDEN, JOB_DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class JobNet(nn.Module):
    """Token embeddings, residual MLP blocks, a final norm and a head; logits flattened over the batch."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(JOB_VOCAB, JOB_DIM)
        self.layers = nn.ModuleList(JobBlock() for _ in range(JOB_LAYERS))
        self.norm = nn.LayerNorm(JOB_DIM)
        self.output = nn.Linear(JOB_DIM, JOB_VOCAB)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h).flatten(0, 1))


# --- 31 and 32: the transformer ----------------------------------------------------------------------------

VOCAB, DIM, LAYERS, HEADS, HIDDEN = 96, 32, 3, 4, 96


class FusedBlock(nn.Module):
    """31's block: pre-norm causal self-attention with q, k and v in one Linear, then an MLP."""

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
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(attention.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class Attention(nn.Module):
    """32's attention: q, k, v and the output each a Linear of its own (what a tensor-parallel plan names)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """32's block: the same computation as :class:`FusedBlock`, in submodules."""

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
    """Token embeddings, a list of blocks (``block``: 31's FusedBlock or 32's Block), a final norm and the head."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS,
                 hidden: int = HIDDEN, block: type[nn.Module] = FusedBlock):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """31's and 32's loss_fn: next-token cross-entropy over the rank's tokens, in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# --- 33: the model DCP saves -------------------------------------------------------------------------------

MLP_IN, MLP_DIM, MLP_HIDDEN, MLP_BLOCKS, MLP_OUT = 16, 48, 96, 2, 12


class ResidualBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPModel(nn.Module):
    """33's Model (36's too): an input Linear, residual MLP blocks, an output Linear."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(MLP_IN, MLP_DIM)
        self.blocks = nn.ModuleList(ResidualBlock(MLP_DIM, MLP_HIDDEN) for _ in range(MLP_BLOCKS))
        self.head = nn.Linear(MLP_DIM, MLP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# --- 34: the model a pipeline splits ------------------------------------------------------------------------

PIPE_VOCAB, PIPE_DIM, PIPE_HIDDEN = 32, 16, 24


class PipelineBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(x)))


class PipelineModel(nn.Module):
    """34's Model: blocks in a ModuleDict (a stage deletes the ones it does not hold), ends that may be None."""

    def __init__(self, vocab: int = PIPE_VOCAB, dim: int = PIPE_DIM, hidden: int = PIPE_HIDDEN, n_layers: int = 4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): PipelineBlock(dim, hidden) for i in range(n_layers)})
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        return self.output(h) if self.output is not None else h


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """34's loss_fn."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
