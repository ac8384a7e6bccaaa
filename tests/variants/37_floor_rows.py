"""Exercise 37, wrong on purpose: each trainer rank is taken to hold n // T rows, the last one the rest, as
an even split by hand would cut them. FSDP2's Shard(0) cuts as torch.chunk does, ceil(n / T) rows each:
with 7 rows over 2 trainer ranks the first holds rows 0-3, not 0-2, and every row from there on comes from
the wrong place."""
# expect-fail: shards-match layout-honoured rank-lists slice-bytes
# expect-pass: returns-shards trainer-to-inference-only
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
        n = p.shape[0]
        per = n // T  # floor: the last trainer takes the rest
        for j, i in enumerate(inference_ranks):
            rows = (j * n // I, (j + 1) * n // I) if dim == 0 else (0, n)
            cols = None
            if p.dim() == 2:
                cols = (j * p.shape[1] // I, (j + 1) * p.shape[1] // I) if dim == 1 else (0, p.shape[1])
            if me == i:
                shards[name] = torch.empty([rows[1] - rows[0]] + ([cols[1] - cols[0]] if cols else []), dtype=p.dtype)
            for k, t in enumerate(trainer_ranks):
                t0, t1 = k * per, (n if k == T - 1 else (k + 1) * per)
                lo, hi = max(t0, rows[0]), min(t1, rows[1])
                if lo >= hi:
                    continue
                if me == t:
                    piece = p.to_local()[lo - t0:hi - t0]
                    sent.append((piece[:, cols[0]:cols[1]] if cols else piece).contiguous())
                    works.append(dist.isend(sent[-1], dst=i))
                elif me == i:
                    works.append(dist.irecv(shards[name][lo - rows[0]:hi - rows[0]], src=t))
    for w in works:
        w.wait()
    return shards if me in inference_ranks else None
