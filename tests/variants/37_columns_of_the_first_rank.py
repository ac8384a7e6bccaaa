"""Exercise 37, wrong on purpose: for a row-parallel weight every trainer rank sends each inference rank the
columns of the first inference rank: the column range is computed once per parameter, outside the loop over
the inference ranks. Every shape and byte count is right; the second inference rank's slice holds the first
one's columns."""
# expect-fail: shards-match layout-honoured
# expect-pass: returns-shards rank-lists slice-bytes trainer-to-inference-only holds-no-whole

import math

import torch
import torch.distributed as dist


def push_weights(model, layout, trainer_ranks, inference_ranks):
    me = dist.get_rank()
    T, I = len(trainer_ranks), len(inference_ranks)
    shards, works, sent = {}, [], []
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        style = layout.get(module)
        n = p.shape[0]
        per = math.ceil(n / T)
        if style == "rowwise" and leaf == "weight":
            width = p.shape[1] // I
            cols = (0, width)  # the first inference rank's columns, for every rank
        else:
            cols = (0, p.shape[1]) if p.dim() == 2 else None
        for j, i in enumerate(inference_ranks):
            rows = (j * n // I, (j + 1) * n // I) if style == "colwise" else (0, n)
            if me == i:
                kept_cols = cols
                if style == "rowwise" and leaf == "weight":
                    kept_cols = (j * width, (j + 1) * width)
                shape = [rows[1] - rows[0]] + ([kept_cols[1] - kept_cols[0]] if kept_cols else [])
                shards[name] = torch.empty(shape, dtype=p.dtype)
            for k, t in enumerate(trainer_ranks):
                t0, t1 = min(k * per, n), min((k + 1) * per, n)
                lo, hi = max(t0, rows[0]), min(t1, rows[1])
                if lo >= hi:
                    continue
                if me == t:
                    piece = p.to_local()[lo - t0:hi - t0]
                    if cols:
                        piece = piece[:, cols[0]:cols[1]]
                    sent.append(piece.contiguous())
                    works.append(dist.isend(sent[-1], dst=i))
                elif me == i:
                    works.append(dist.irecv(shards[name][lo - rows[0]:hi - rows[0]], src=t))
    for w in works:
        w.wait()
    return shards if me in inference_ranks else None
