"""Exercise 37, wrong on purpose: each inference rank confirms the sync by sending every trainer rank a
one-element flag once its slices have arrived, and the trainer ranks wait for the flags. The slices and the
bytes of the weights are right, but a message goes back from the inference ranks: the receiver knows what is
coming and when it is complete, so nothing needs to travel the other way."""
# expect-fail: trainer-to-inference-only
# expect-not-checked: slice-bytes
# expect-pass: returns-shards shards-match layout-honoured rank-lists holds-no-whole

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
        dim = 0 if style == "colwise" else (1 if style == "rowwise" and leaf == "weight" else None)
        n, per = p.shape[0], math.ceil(p.shape[0] / T)
        for j, i in enumerate(inference_ranks):
            rows = (j * n // I, (j + 1) * n // I) if dim == 0 else (0, n)
            cols = None
            if p.dim() == 2:
                cols = (j * p.shape[1] // I, (j + 1) * p.shape[1] // I) if dim == 1 else (0, p.shape[1])
            if me == i:
                shards[name] = torch.empty([rows[1] - rows[0]] + ([cols[1] - cols[0]] if cols else []),
                                           dtype=p.dtype)
            for k, t in enumerate(trainer_ranks):
                lo, hi = max(k * per, rows[0]), min(min((k + 1) * per, n), rows[1])
                if lo >= hi:
                    continue
                if me == t:
                    piece = p.to_local()[lo - k * per:hi - k * per]
                    sent.append((piece[:, cols[0]:cols[1]] if cols else piece).contiguous())
                    works.append(dist.isend(sent[-1], dst=i))
                elif me == i:
                    works.append(dist.irecv(shards[name][lo - rows[0]:hi - rows[0]], src=t))
    for w in works:
        w.wait()
    flag = torch.ones(1)
    if me in inference_ranks:
        for t in trainer_ranks:
            dist.send(flag, dst=t)
        return shards
    for i in inference_ranks:
        dist.recv(flag, src=i)
    return None
