"""Exercise 37, wrong on purpose: the placements come from the modules' names, as one engine's plan would
have them (every up projection and the head column-parallel, every down projection row-parallel), not from
layout. Right for the usual layout; with another engine's layout (the input projection row-parallel, the last
block and the head replicated) the slices are cut the wrong way."""
# expect-fail: layout-honoured
# expect-pass: returns-shards shards-match trainer-to-inference-only

import math

import torch
import torch.distributed as dist

COLUMN_PARALLEL = (".up", "out")
ROW_PARALLEL = (".down",)


def placement(name):
    module, _, leaf = name.rpartition(".")
    if module.endswith(COLUMN_PARALLEL):
        return 0
    if module.endswith(ROW_PARALLEL) and leaf == "weight":
        return 1
    return None


def push_weights(model, layout, trainer_ranks, inference_ranks):
    me = dist.get_rank()
    T, I = len(trainer_ranks), len(inference_ranks)
    result, pending, buffers = {}, [], []
    for name, p in model.named_parameters():
        dim = placement(name)
        n = p.shape[0]
        per = math.ceil(n / T)
        for j, i in enumerate(inference_ranks):
            rows = (j * n // I, (j + 1) * n // I) if dim == 0 else (0, n)
            cols = None
            if p.dim() == 2:
                cols = (j * p.shape[1] // I, (j + 1) * p.shape[1] // I) if dim == 1 else (0, p.shape[1])
            if me == i:
                result[name] = torch.empty([rows[1] - rows[0]] + ([cols[1] - cols[0]] if cols else []),
                                           dtype=p.dtype)
            for k, t in enumerate(trainer_ranks):
                lo, hi = max(k * per, rows[0]), min(min((k + 1) * per, n), rows[1])
                if lo >= hi:
                    continue
                if me == t:
                    piece = p.to_local()[lo - k * per:hi - k * per]
                    buffers.append((piece[:, cols[0]:cols[1]] if cols else piece).contiguous())
                    pending.append(dist.isend(buffers[-1], dst=i))
                elif me == i:
                    pending.append(dist.irecv(result[name][lo - rows[0]:hi - rows[0]], src=t))
    for work in pending:
        work.wait()
    return result if me in inference_ranks else None
