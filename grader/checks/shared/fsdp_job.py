"""The debugging track's FSDP2 jobs (28 and up): the scripts' model and data, and what the grader reads
back of a job (the model rank 0 saves) and replays in one process (the data file its ranks write:
:func:`grader.rank.drivers.shared.debug_rank.job_tokens`).

A script of this family trains :class:`~grader.rank.drivers.shared.stub_models.JobNet` (token embeddings, residual MLP blocks, a final norm, a
head) sharded with fully_shard on a 1-D mesh, with SGD and momentum, a DistributedSampler (shuffle,
seed 0) and a DataLoader of BATCH_SIZE, and rank 0 saves the full state dict to --out/model.pt at the
end. The replay trains the same model in one process on the same global batches (the ranks' batches
of each step together; FSDP averages the gradients over the ranks).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from grader.rank import untrusted
from grader.checks.shared.debug_replay import load_into, replay
from grader.rank.drivers.shared.debug_rank import JOB_SAMPLES
from grader.rank.drivers.shared.stub_models import JobNet

BATCH_SIZE = 4
LR, MOMENTUM = 0.05, 0.9
N_TRAIN = JOB_SAMPLES  # the data file's samples (debug_rank.job_tokens): 2 ranks, 6 steps an epoch; 3 ranks, 4
TOLERANCE = 2e-5  # float32, gradients averaged by a reduce-scatter instead of in one process
MODEL_FILE = "model.pt"


def build_model() -> JobNet:
    torch.manual_seed(0)
    return JobNet()


def sampler_batches(world_size: int, epochs, n: int = N_TRAIN) -> list[list[list[list[int]]]]:
    """per_rank[r][s]: rank r's batch (sample ids, one micro-batch) at step s over ``epochs`` (a range), as
    DistributedSampler (shuffle, seed 0, set_epoch) and a DataLoader of BATCH_SIZE hand them out."""
    from torch.utils.data import DistributedSampler

    per_rank: list[list] = [[] for _ in range(world_size)]
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        for epoch in epochs:
            sampler.set_epoch(epoch)
            ids = list(sampler)
            per_rank[rank] += [[ids[i:i + BATCH_SIZE]] for i in range(0, len(ids), BATCH_SIZE)]
    return per_rank


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    return F.cross_entropy(model(x), y.flatten())


def saved_model(run_dir: str) -> tuple[dict | None, str]:
    """The state dict rank 0 saved to --out/model.pt, or None and why not, in words."""
    path = os.path.join(run_dir, "out", MODEL_FILE)
    if not untrusted.exists(path):
        return None, f"rank 0 saved no {MODEL_FILE} in --out after training"
    try:
        saved = untrusted.load_tensors(path)
    except untrusted.Unreadable as exc:  # a file the script wrote: anything may be wrong with it
        return None, f"the {MODEL_FILE} rank 0 saved does not load: {exc}"
    misfit = load_into(build_model(), saved) if isinstance(saved, dict) else "it is not a state dict"
    if misfit:
        return None, f"the {MODEL_FILE} rank 0 saved is not the script's model: {misfit}"
    return saved, ""


def replayed(data: dict, phases: list[tuple[int, range]]) -> dict:
    """The model after one process trains on the global batches of each (world size, epochs) phase in
    turn, the momentum carried from one phase to the next."""
    model = build_model()
    buffers = None
    for world_size, epochs in phases:
        buffers = replay(model, sampler_batches(world_size, epochs), data["train_x"], data["train_y"], lr=LR,
                         loss_fn=loss_fn, momentum=MOMENTUM, buffers=buffers)
    return {k: v.detach() for k, v in model.state_dict().items()}


def replay_difference(saved: dict, data: dict, phases: list[tuple[int, range]]):
    """The largest difference between ``saved`` and the replay of ``phases``, or None within TOLERANCE."""
    from grader.compare import largest_difference

    found = largest_difference(saved, replayed(data, phases))
    return None if found is None or found.max_abs <= TOLERANCE else found
