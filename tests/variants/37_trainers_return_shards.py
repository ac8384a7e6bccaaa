"""Exercise 37, wrong on purpose: every rank returns what it holds after the sync, the trainer ranks their
FSDP2 shards too. The inference ranks' slices are right; a trainer rank should return None (its weights stay
in the model, and the caller tells the two kinds of rank apart by it)."""
# expect-fail: returns-shards
# expect-pass: shards-match layout-honoured rank-lists slice-bytes trainer-to-inference-only holds-no-whole

import math

import torch
import torch.distributed as dist


def _rows(n, trainers, k):
    per = math.ceil(n / trainers)
    return min(k * per, n), min((k + 1) * per, n)


def _dim(name, layout):
    module, _, leaf = name.rpartition(".")
    style = layout.get(module)
    return 0 if style == "colwise" else (1 if style == "rowwise" and leaf == "weight" else None)


def _kept(shape, dim, inference, j):
    ranges = [[0, size] for size in shape]
    if dim is not None:
        ranges[dim] = [j * shape[dim] // inference, (j + 1) * shape[dim] // inference]
    return ranges


def push_weights(model, layout, trainer_ranks, inference_ranks):
    me = dist.get_rank()
    out, works, keep = {}, [], []
    for name, p in model.named_parameters():
        dim = _dim(name, layout)
        if me in inference_ranks:
            ranges = _kept(list(p.shape), dim, len(inference_ranks), inference_ranks.index(me))
            out[name] = torch.empty([b - a for a, b in ranges], dtype=p.dtype)
        else:
            out[name] = p.to_local()
        for k, t in enumerate(trainer_ranks):
            t0, t1 = _rows(p.shape[0], len(trainer_ranks), k)
            for j, i in enumerate(inference_ranks):
                ranges = _kept(list(p.shape), dim, len(inference_ranks), j)
                lo, hi = max(t0, ranges[0][0]), min(t1, ranges[0][1])
                if lo >= hi:
                    continue
                if me == t:
                    piece = p.to_local()[lo - t0:hi - t0]
                    if len(ranges) > 1:
                        piece = piece[:, ranges[1][0]:ranges[1][1]]
                    keep.append(piece.contiguous())
                    works.append(dist.isend(keep[-1], dst=i))
                elif me == i:
                    works.append(dist.irecv(out[name][lo - ranges[0][0]:hi - ranges[0][0]], src=t))
    for w in works:
        w.wait()
    return out
