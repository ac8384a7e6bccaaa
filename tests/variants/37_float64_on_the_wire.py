"""Exercise 37, wrong on purpose: every slice travels in float64 "to lose nothing on the way", and the
inference rank casts it back to the parameter's dtype. A float32 value survives the round trip exactly, so
the slices are right; a float32 layout moves twice its bytes."""
# expect-fail: slice-bytes
# expect-pass: returns-shards shards-match layout-honoured rank-lists trainer-to-inference-only holds-no-whole

import math

import torch
import torch.distributed as dist


def push_weights(model, layout, trainer_ranks, inference_ranks):
    me = dist.get_rank()
    T, I = len(trainer_ranks), len(inference_ranks)
    kept, staging, works, outgoing = {}, [], [], []
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        style = layout.get(module)
        dim = 0 if style == "colwise" else (1 if style == "rowwise" and leaf == "weight" else None)
        n = p.shape[0]
        per = math.ceil(n / T)
        for j, i in enumerate(inference_ranks):
            rows = (j * n // I, (j + 1) * n // I) if dim == 0 else (0, n)
            cols = None
            if p.dim() == 2:
                cols = (j * p.shape[1] // I, (j + 1) * p.shape[1] // I) if dim == 1 else (0, p.shape[1])
            if me == i:
                kept[name] = torch.empty([rows[1] - rows[0]] + ([cols[1] - cols[0]] if cols else []),
                                         dtype=torch.float64)
            for k, t in enumerate(trainer_ranks):
                t0 = k * per
                lo, hi = max(t0, rows[0]), min(min(t0 + per, n), rows[1])
                if lo >= hi:
                    continue
                if me == t:
                    piece = p.to_local()[lo - t0:hi - t0]
                    outgoing.append((piece[:, cols[0]:cols[1]] if cols else piece).to(torch.float64).contiguous())
                    works.append(dist.isend(outgoing[-1], dst=i))
                elif me == i:
                    works.append(dist.irecv(kept[name][lo - rows[0]:hi - rows[0]], src=t))
            if me == i:
                staging.append((name, p.dtype))
    for w in works:
        w.wait()
    if me in trainer_ranks:
        return None
    return {name: kept[name].to(dtype) for name, dtype in staging}
