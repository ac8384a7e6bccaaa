"""Exercise 37, wrong on purpose: a row-parallel layer's bias is split along dim 0 like a column-parallel
one's, as if "rowwise" split every parameter of the module. The bias of a row-parallel layer is kept whole:
each rank's partial product has every output, and vLLM's RowParallelLinear adds the whole bias on one rank so
that the all-reduced sum counts it once; a slice of it is the wrong shape for the engine."""
# expect-fail: shards-match
# expect-pass: returns-shards trainer-to-inference-only

import math

import torch
import torch.distributed as dist


def push_weights(model, layout, trainer_ranks, inference_ranks):
    me = dist.get_rank()
    T, I = len(trainer_ranks), len(inference_ranks)
    shards, works, sent = {}, [], []
    for name, p in model.named_parameters():
        style = layout.get(name.rpartition(".")[0])
        dim = None
        if style == "colwise":
            dim = 0
        elif style == "rowwise":
            dim = p.dim() - 1  # the input dimension: 1 for the weight, and (wrongly) 0 for the bias
        n = p.shape[0]
        per = math.ceil(n / T)
        for j, i in enumerate(inference_ranks):
            rows, cols = (0, n), None
            if p.dim() == 2:
                cols = (0, p.shape[1])
            if dim == 0:
                rows = (j * n // I, (j + 1) * n // I)
            elif dim == 1:
                cols = (j * p.shape[1] // I, (j + 1) * p.shape[1] // I)
            if me == i:
                shape = [rows[1] - rows[0]] + ([cols[1] - cols[0]] if cols else [])
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
