"""Right answer for exercise 34 with a Stage module of its own built from index ranges, the ranks from
the environment (as torchrun sets them), a name-to-class table, and the micro-batch scaling done in
the loss function (each micro-batch's loss divided by n_microbatches, scale_grads=False), so the
losses the schedule collects add up to the batch's mean loss. It logs the loss every step."""


import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)


class Block(nn.Module):
    """An MLP added to its input."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.tanh(self.w1(x)))


class Model(nn.Module):
    """Token embeddings, blocks keyed "0", "1", ..., and the output head; a part set to None is skipped."""

    def __init__(self, vocab: int = 32, dim: int = 16, hidden: int = 24, n_layers: int = 4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, hidden) for i in range(n_layers)})
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        return self.output(h) if self.output is not None else h


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, averaged over the tokens of one micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())



class Stage(nn.Module):
    """Blocks [first, last) of a model, with its embeddings in front and its head behind when asked."""

    def __init__(self, model, first: int, last: int, embed: bool, head: bool):
        super().__init__()
        self.embed = model.tok_embeddings if embed else None
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in range(first, last))
        self.head = model.output if head else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


SCHEDULE_CLASSES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved1f1b": (ScheduleInterleaved1F1B, 2),
}


def build_pipeline(model, rank, world_size, n_microbatches, schedule_name, device):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    schedule_class, virtual = SCHEDULE_CLASSES[schedule_name.lower()]
    total = virtual * world_size
    blocks_per_stage = len(model.layers) // total
    mine = [rank + v * world_size for v in range(virtual)]
    modules = [Stage(model, s * blocks_per_stage, (s + 1) * blocks_per_stage, embed=s == 0, head=s == total - 1)
               for s in mine]
    stages = [PipelineStage(m.to(device), s, total, device) for m, s in zip(modules, mine)]

    def scaled_loss(logits, targets):
        return loss_fn(logits, targets) / n_microbatches

    schedule = schedule_class(stages if virtual > 1 else stages[0], n_microbatches, loss_fn=scaled_loss,
                              scale_grads=False)
    return schedule, modules


def train_step(schedule, tokens, targets, rank, world_size, optimizer):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args = (tokens,) if rank == 0 else ()
    kwargs = {}
    losses = []
    if rank == world_size - 1:
        kwargs = {"target": targets, "losses": losses}
    schedule.step(*args, **kwargs)
    optimizer.step()
    optimizer.zero_grad()
    if not losses:
        return None
    loss = sum(float(x) for x in losses)  # each already divided by n_microbatches
    print(f"rank {rank}: loss {loss:.4f}")
    return loss
