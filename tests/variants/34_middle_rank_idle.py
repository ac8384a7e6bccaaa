"""Exercise 34, broken: calls schedule.step on the first and the last rank only: on 3 ranks the
middle one never runs its stage, and its neighbours wait for it."""
# expect-fail: matches-single-process


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


SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}


def build_pipeline(model: Model, rank: int, world_size: int, n_microbatches: int, schedule_name: str,
                   device: torch.device):
    stages_per_rank = 2 if schedule_name == "Interleaved1F1B" else 1
    num_stages = world_size * stages_per_rank
    blocks = list(model.layers.values())
    per_stage = len(blocks) // num_stages

    stage_modules, stages = [], []
    # Looped: rank r holds stages r, r + W, ..., so every activation goes on to the next rank.
    for stage_index in range(rank, num_stages, world_size):
        parts = blocks[stage_index * per_stage:(stage_index + 1) * per_stage]
        if stage_index == 0:
            parts = [model.tok_embeddings] + parts
        if stage_index == num_stages - 1:
            parts = parts + [model.output]
        # Only these modules stay referenced: the model's other layers are freed with the model.
        module = nn.Sequential(*parts).to(device)
        stage_modules.append(module)
        stages.append(PipelineStage(module, stage_index, num_stages, device))

    schedule_class = SCHEDULES[schedule_name]
    # GPipe and 1F1B take this rank's one stage; the interleaved schedule takes the list.
    schedule = schedule_class(stages[0] if stages_per_rank == 1 else stages, n_microbatches, loss_fn=loss_fn)
    return schedule, stage_modules


def train_step(schedule, tokens: torch.Tensor, targets: torch.Tensor, rank: int, world_size: int,
               optimizer: torch.optim.Optimizer) -> float | None:
    # Rank 0 holds the first stage and rank world_size - 1 the last, with one stage per rank or looped.
    losses = []
    if rank == 0:
        schedule.step(tokens)
    elif rank == world_size - 1:
        schedule.step(target=targets, losses=losses)
    # The gradients are already those of the mean loss: the schedule divides their sum over the
    # micro-batches by n_microbatches (scale_grads=True, the default, for a loss_fn that averages).
    optimizer.step()
    optimizer.zero_grad()
    if rank == world_size - 1:
        return torch.stack(losses).mean().item()
    return None
