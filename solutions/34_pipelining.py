"""Exercise 34: a pipeline with torch.distributed.pipelining: GPipe, 1F1B and interleaved 1F1B.

Exercise 13 scheduled a pipeline by hand over send and recv. Production code uses
torch's own: `torch.distributed.pipelining`. A `PipelineStage` wraps the module one
stage runs (its index among num_stages, the device); a schedule runs one training
step of n_microbatches micro-batches through the stages, sending each micro-batch's
activation to the next stage and its gradient back, in its own order of forwards
and backwards. `ScheduleGPipe` runs every forward, then every backward;
`Schedule1F1B` alternates one forward and one backward after a short warm-up, so a
stage holds at most num_stages micro-batches' activations; and
`ScheduleInterleaved1F1B` gives each rank two stages, looped (on W ranks, rank r
holds stages r and r + W), which shortens the pipeline's fill and drain.

The grader starts W ranks and the process group (gloo on CPU), builds the same
`Model` (below) on every rank, in float64, and for each schedule name ("GPipe",
"1F1B", "Interleaved1F1B", torch's names) trains it with your functions:

    model = Model(n_layers=2 * W)
    schedule, stage_modules = build_pipeline(model, rank, W, n_microbatches, schedule_name, device)
    optimizer = torch.optim.SGD([p for m in stage_modules for p in m.parameters()], lr=...)
    for each step:
        loss = train_step(schedule, tokens, targets, rank, W, optimizer)   # the same whole batch on every rank

    build_pipeline(model, rank, world_size, n_microbatches, schedule_name, device)
            -> (schedule, stage_modules)
        Cut the model into num_stages stages: W for "GPipe" and "1F1B", 2 * W for
        "Interleaved1F1B". Stage s of S runs the blocks model.layers[str(i)] for
        i in [s * L // S, (s + 1) * L // S) (L = len(model.layers)), stage 0 runs
        tok_embeddings first and stage S - 1 runs output last. This rank holds stage
        rank, or stages rank and rank + W for the interleaved schedule, and nothing
        else of the model (its other layers are freed once build_pipeline returns).
        Wrap each of its stage modules in PipelineStage(module, stage_index,
        num_stages, device) and build the named schedule over them (one stage, or the
        list of two) with n_microbatches and loss_fn (below). Return the schedule and
        the list of this rank's stage modules, in stage order.
    train_step(schedule, tokens, targets, rank, world_size, optimizer) -> float | None
        One training step on the whole batch (tokens, targets: every rank gets it).
        The rank holding the first stage feeds the tokens; the rank holding the last
        stage gives the targets and collects the micro-batches' losses. The step's
        gradients are those of the mean loss over the whole batch (each micro-batch's
        mean loss counts 1/n_microbatches); then every rank steps its optimizer and
        clears the gradients. Return the mean of the micro-batch losses as a Python
        float on the rank holding the last stage, None on the others.

`Model.forward` skips tok_embeddings and output when they are None, so a copy of
the model with the other stages' parts deleted runs as one stage, as torchtitan
cuts its models; a stage built from the model's modules (nn.Sequential) works too.

The grader measures what each rank holds (the values of every parameter, searched
for in the tensors reachable from what build_pipeline returned and from your
module), which stages it built and what each runs, every message each rank sends
(only to the ranks holding the neighbouring stages; one activation per micro-batch
forward and one gradient back), the order of each stage's forwards and backwards
and the activations alive at once (the named schedule), the loss, and every rank's
parameters after three steps against one process training the whole model on the
same micro-batches.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/34_pipelining.py      (stuck? ddp-grade hint 34)
"""

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
    else:
        schedule.step()
    # The gradients are already those of the mean loss: the schedule divides their sum over the
    # micro-batches by n_microbatches (scale_grads=True, the default, for a loss_fn that averages).
    optimizer.step()
    optimizer.zero_grad()
    if rank == world_size - 1:
        return torch.stack(losses).mean().item()
    return None
