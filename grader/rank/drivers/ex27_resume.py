"""Exercise 27: after resuming from a checkpoint the ranks disagree (only rank 0 read it): the drivers, run in
each rank (the checks that decide: grader/checks/ex27_resume.py).

Every rank writes the same checkpoint (the grader's own earlier run: weights, SGD momentum buffers, epoch 1)
and runs the script's main() with --resume under torchrun's variables.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from grader.rank.drivers.shared import debug_rank
from grader.rank.child import RankContext
from grader.rank.drivers.shared.stub_models import TwoLayerNet


EPOCHS = 2  # trained after the resume
LR = 0.1
MOMENTUM = 0.9
CHECKPOINT_EPOCH = 1  # the checkpoint was saved after epoch 1: the resumed run trains epochs 2 and 3
N_TRAIN, N_VAL = 96, 48


def make_data() -> dict:
    return debug_rank.make_data(seed=27, n_train=N_TRAIN, n_val=N_VAL)


def make_checkpoint(data: dict) -> dict:
    """An earlier run's checkpoint, the same in every process: a few SGD steps with momentum."""
    torch.manual_seed(2700)
    model = TwoLayerNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(6):
        x = data["train_x"][step * 16:(step + 1) * 16]
        y = data["train_y"][step * 16:(step + 1) * 16]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": CHECKPOINT_EPOCH}


def rank_main(ctx: RankContext) -> dict:
    data = make_data()
    path = debug_rank.write_data(ctx, data)
    checkpoint = make_checkpoint(data)
    resume = os.path.join(ctx.run_dir, "inputs", "checkpoint.pt")
    debug_rank.write_shared(resume, checkpoint, ctx.rank)
    result = debug_rank.run_job(ctx, ["--data", path, "--resume", resume], epochs=EPOCHS)
    if ctx.rank == 0:
        state = checkpoint["optimizer"]["state"]
        result["checkpoint"] = {
            "model": {k: v.clone() for k, v in checkpoint["model"].items()},
            "buffers": [state[i]["momentum_buffer"].clone() if i in state else None
                        for i in range(len(list(TwoLayerNet().parameters())))],
        }
    return result
