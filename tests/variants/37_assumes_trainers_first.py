"""Exercise 37, wrong on purpose: the inference ranks are taken to follow the trainer ranks, so the j-th
inference rank is global rank T + j and the k-th trainer rank is rank k. True when the job lays the trainers
out first; with trainer_ranks=[1, 2] and inference_ranks=[0] the messages go to the wrong ranks."""
# expect-fail: rank-lists
# expect-pass: returns-shards shards-match layout-honoured

import math

import torch
import torch.distributed as dist


def push_weights(model, layout, trainer_ranks, inference_ranks):
    rank = dist.get_rank()
    T, I = len(trainer_ranks), len(inference_ranks)
    trainer = rank < T
    out, works, held = {}, [], []
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        style = layout.get(module)
        dim = 0 if style == "colwise" else (1 if style == "rowwise" and leaf == "weight" else None)
        n = p.shape[0]
        per = math.ceil(n / T)
        for j in range(I):
            rows = (j * n // I, (j + 1) * n // I) if dim == 0 else (0, n)
            cols = None
            if p.dim() == 2:
                cols = (j * p.shape[1] // I, (j + 1) * p.shape[1] // I) if dim == 1 else (0, p.shape[1])
            if not trainer and rank - T == j:
                out[name] = torch.empty([rows[1] - rows[0]] + ([cols[1] - cols[0]] if cols else []), dtype=p.dtype)
            for k in range(T):
                lo, hi = max(k * per, rows[0]), min(min((k + 1) * per, n), rows[1])
                if lo >= hi:
                    continue
                if trainer and rank == k:
                    piece = p.to_local()[lo - k * per:hi - k * per]
                    held.append((piece[:, cols[0]:cols[1]] if cols else piece).contiguous())
                    works.append(dist.isend(held[-1], dst=T + j))
                elif not trainer and rank - T == j:
                    works.append(dist.irecv(out[name][lo - rows[0]:hi - rows[0]], src=k))
    for w in works:
        w.wait()
    return None if trainer else out
