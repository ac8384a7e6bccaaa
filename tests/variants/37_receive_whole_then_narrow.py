"""Exercise 37, wrong on purpose: the shape of verl's and OpenRLHF's syncs without the gather on the trainer:
every trainer rank sends its whole shard of every parameter to every inference rank, which puts the rows
together and narrows out its slice, as vLLM's weight loader narrows a broadcast parameter. The slices are
right; each inference rank holds every split parameter whole, and receives I times what it keeps of it."""
# expect-fail: holds-no-whole slice-bytes
# expect-pass: returns-shards shards-match layout-honoured rank-lists trainer-to-inference-only

import math

import torch
import torch.distributed as dist


def push_weights(model, layout, trainer_ranks, inference_ranks):
    me = dist.get_rank()
    T, I = len(trainer_ranks), len(inference_ranks)
    if me in trainer_ranks:
        sends = []
        for name, p in model.named_parameters():
            local = p.to_local().contiguous()
            if local.shape[0] == 0:
                continue
            for i in inference_ranks:
                sends.append(dist.isend(local, dst=i))
        for s in sends:
            s.wait()
        return None
    j = inference_ranks.index(me)
    out = {}
    for name, p in model.named_parameters():
        whole = torch.empty(p.shape, dtype=p.dtype)
        per = math.ceil(p.shape[0] / T)
        recvs = []
        for k, t in enumerate(trainer_ranks):
            lo, hi = min(k * per, p.shape[0]), min((k + 1) * per, p.shape[0])
            if lo < hi:
                recvs.append(dist.irecv(whole[lo:hi], src=t))
        for r in recvs:
            r.wait()
        module, _, leaf = name.rpartition(".")
        style = layout.get(module)
        dim = 0 if style == "colwise" else (1 if style == "rowwise" and leaf == "weight" else None)
        if dim is None:
            out[name] = whole
        else:
            size = p.shape[dim] // I
            out[name] = whole.narrow(dim, j * size, size).clone()
    return out
