"""Exercise 06, broken: concatenates the micro-batches into one forward pass, which is what accumulation avoids."""
# expect-fail: sync-on-last

import contextlib

import torch


def accumulate_and_step(ddp_model, optimizer, micro_batches, loss_fn) -> float:
    num_micro = len(micro_batches)
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    loss = loss_fn(ddp_model(x), y)
    loss.backward()
    losses = [loss.item()] * num_micro

    optimizer.step()
    optimizer.zero_grad()
    return sum(losses) / num_micro
