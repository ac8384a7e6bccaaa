"""Exercise 15, grader side: the same training nobody interrupted, in the grader's own process."""

from __future__ import annotations

import torch
from torch import nn

from grader.rank.drivers.ex15_elastic import (BATCH_SIZE, EPOCHS, LR, MOMENTUM, NUM_SAMPLES, SEED, build_dataset,
                                             build_model)


def uninterrupted(world_size: int) -> dict:
    """EPOCHS epochs of the exercise's training on ``world_size`` ranks, without a failure, in one process.

    Each step: the mean over ranks of each rank's mean loss on its batch (what DDP's averaged
    gradients are the gradient of), then SGD with momentum, written out (torch.optim would import
    torch._dynamo here).
    """
    from torch.utils.data import DistributedSampler

    with torch.random.fork_rng():
        model = build_model()
    dataset = build_dataset()
    x_all, y_all = dataset.tensors
    buffers: dict = {}
    for epoch in range(EPOCHS):
        orders = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        for step in range(NUM_SAMPLES // (world_size * BATCH_SIZE)):
            model.zero_grad()
            losses = []
            for order in orders:
                idx = torch.tensor(order[step * BATCH_SIZE:(step + 1) * BATCH_SIZE])
                losses.append(nn.functional.cross_entropy(model(x_all[idx]), y_all[idx]))
            (sum(losses) / world_size).backward()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    buf = buffers.get(name)
                    buf = p.grad.clone() if buf is None else buf.mul_(MOMENTUM).add_(p.grad)
                    buffers[name] = buf
                    p.add_(buf, alpha=-LR)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
