"""Right answer for exercise 52, written as torch.distributed.pipelining writes its zero-bubble schedule: one list of
actions per rank built first (warm-up forwards, forward and input-backward pairs with a weight pass once the rank's
first rounds are done, the cooldown, then the weight passes left), then walked.

B and W with torch.autograd.grad (the weights' gradients added to .grad by hand); ranks and world size from the
environment; a shape header before every micro-batch; receives as irecv + wait; the losses summed as tensors.
"""

import os

import torch
import torch.distributed as dist

FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "I", "W"


def rank_actions(rank, n_ranks, n_micro):
    warmup_ops = min(n_ranks - 1 - rank, n_micro)
    fwd_bwd_ops = n_micro - warmup_ops
    actions, fwd, bwd, weight_ops, backward_ops = [], 0, 0, 0, 0
    for op in range(warmup_ops + fwd_bwd_ops + warmup_ops):
        if op < warmup_ops:
            actions.append((FORWARD, fwd))
            fwd += 1
            continue
        if op < warmup_ops + fwd_bwd_ops:
            actions.append((FORWARD, fwd))
            fwd += 1
        actions.append((BACKWARD_INPUT, bwd))
        bwd += 1
        backward_ops += 1
        if op - warmup_ops >= rank:  # zero bubble: a weight pass joins each round after the first `rank`
            actions.append((BACKWARD_WEIGHT, weight_ops))
            weight_ops += 1
    actions += [(BACKWARD_WEIGHT, i) for i in range(weight_ops, backward_ops)]
    return actions


def zero_bubble_step(stage, batch, target, num_microbatches, loss_fn):
    rank = int(os.environ["RANK"])
    n_ranks = int(os.environ["WORLD_SIZE"])
    prev_rank = rank - 1 if rank > 0 else None
    next_rank = rank + 1 if rank < n_ranks - 1 else None
    weights = [p for p in stage.parameters() if p.requires_grad]
    dtype, device = weights[0].dtype, weights[0].device

    micro_in = torch.tensor_split(batch, num_microbatches) if prev_rank is None else None
    micro_target = torch.tensor_split(target, num_microbatches) if next_rank is None else None
    stash = {}
    in_flight = []
    loss_total = torch.zeros((), dtype=torch.float64)

    def receive(shape, src):
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.irecv(buffer, src).wait()
        return buffer

    for action, mb in rank_actions(rank, n_ranks, num_microbatches):
        if action == FORWARD:
            if prev_rank is None:
                inp = micro_in[mb]
            else:
                header = torch.empty(2, dtype=torch.int64)
                dist.irecv(header, prev_rank).wait()
                inp = receive(tuple(header.tolist()), prev_rank).requires_grad_()
            out = stage(inp)
            if next_rank is None:
                loss = loss_fn(out, micro_target[mb])
                loss_total += loss.detach()
                out = loss / num_microbatches
            else:
                in_flight.append(dist.isend(torch.tensor(list(out.shape), dtype=torch.int64), next_rank))
                in_flight.append(dist.isend(out.detach(), next_rank))
            stash[mb] = {"inp": inp, "out": out, "grad": None}
        elif action == BACKWARD_INPUT:
            entry = stash[mb]
            if next_rank is not None:
                entry["grad"] = receive(entry["out"].shape, next_rank)
            if prev_rank is not None:
                (grad_in,) = torch.autograd.grad(entry["out"], entry["inp"], entry["grad"], retain_graph=True)
                in_flight.append(dist.isend(grad_in, prev_rank))
        else:
            entry = stash.pop(mb)
            grads = torch.autograd.grad(entry["out"], weights, entry["grad"])
            for weight, grad in zip(weights, grads):
                if weight.grad is None:
                    weight.grad = grad
                else:
                    weight.grad.add_(grad)
    for work in in_flight:
        work.wait()
    return (loss_total / num_microbatches).item() if next_rank is None else None
