"""push_weights with blocking send and recv, no asynchronous work: every rank walks the same (parameter,
trainer, inference rank) triples in the same order, so each blocking send meets its receive. The receiver
takes each message into a fresh buffer and copies it into place with narrow(); the offsets come from the
DTensor placements' own arithmetic written out (torch.chunk's ceil)."""

import math

import torch
import torch.distributed as dist


def owned_rows(n, count, index):
    size = math.ceil(n / count)
    return min(n, index * size), min(n, (index + 1) * size)


def push_weights(model, layout, trainer_ranks, inference_ranks):
    me = dist.get_rank()
    result = {} if me in inference_ranks else None
    for name, param in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        style = layout.get(module, "replicate")
        split = {"colwise": 0, "rowwise": 1}.get(style)
        if split == 1 and not name.endswith(".weight"):
            split = None  # a row-parallel bias is added once, whole
        per_rank = param.shape[split] // len(inference_ranks) if split is not None else None

        if result is not None:
            shape = list(param.shape)
            if split is not None:
                shape[split] = per_rank
            result[name] = torch.empty(shape, dtype=param.dtype)

        for k, trainer in enumerate(trainer_ranks):
            first, last = owned_rows(param.shape[0], len(trainer_ranks), k)
            for j, target in enumerate(inference_ranks):
                if me not in (trainer, target):
                    continue
                row_lo, row_hi = (j * per_rank, (j + 1) * per_rank) if split == 0 else (0, param.shape[0])
                lo, hi = max(first, row_lo), min(last, row_hi)
                if lo >= hi:
                    continue
                if me == trainer:
                    block = param.to_local().narrow(0, lo - first, hi - lo)
                    if split == 1:
                        block = block.narrow(1, j * per_rank, per_rank)
                    dist.send(block.contiguous(), dst=target)
                else:
                    incoming = torch.empty([hi - lo] + list(result[name].shape[1:]), dtype=param.dtype)
                    dist.recv(incoming, src=trainer)
                    result[name].narrow(0, lo - row_lo, hi - lo).copy_(incoming)
    return result
