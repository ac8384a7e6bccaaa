"""push_weights as a transfer plan: the rows each trainer rank holds come from torch.chunk of the row indices
(what FSDP2's Shard(0) does to the rows), the slice each inference rank keeps from the layout, and every
overlap becomes one entry of the plan; the whole plan then goes out as one dist.batch_isend_irecv. The rank
comes from the environment, as torchrun sets it."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Transfer:
    name: str
    src: int
    dst: int
    src_rows: slice  # rows of the trainer's local shard
    dst_rows: slice  # rows of the inference rank's slice
    cols: slice  # columns of both (the whole width unless the inference rank keeps some columns)


def row_chunks(n, parts):
    """[start, stop) of each part of torch.chunk over n rows (missing parts empty)."""
    chunks = torch.arange(n).chunk(parts)
    out = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
    return out + [(n, n)] * (parts - len(out))


def placement(name, layout):
    module, _, leaf = name.rpartition(".")
    return {"colwise": 0, "rowwise": 1 if leaf == "weight" else None}.get(layout.get(module))


def kept(shape, dim, parts, j):
    rows, cols = slice(0, shape[0]), slice(0, shape[1] if len(shape) > 1 else 1)
    if dim is not None:
        step = shape[dim] // parts
        part = slice(j * step, (j + 1) * step)
        rows, cols = (part, cols) if dim == 0 else (rows, part)
    return rows, cols


def plan(model, layout, trainer_ranks, inference_ranks):
    transfers = []
    for name, p in model.named_parameters():
        shape, dim = list(p.shape), placement(name, layout)
        held = row_chunks(shape[0], len(trainer_ranks))
        for j, dst in enumerate(inference_ranks):
            rows, cols = kept(shape, dim, len(inference_ranks), j)
            for (start, stop), src in zip(held, trainer_ranks):
                lo, hi = max(start, rows.start), min(stop, rows.stop)
                if lo < hi:
                    transfers.append(Transfer(name, src, dst, slice(lo - start, hi - start),
                                              slice(lo - rows.start, hi - rows.start), cols))
    return transfers


def push_weights(model, layout, trainer_ranks, inference_ranks):
    rank = int(os.environ["RANK"])
    params = dict(model.named_parameters())
    device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device("cuda", torch.cuda.current_device())
    slices = {}
    if rank in inference_ranks:
        j = inference_ranks.index(rank)
        for name, p in params.items():
            rows, cols = kept(list(p.shape), placement(name, layout), len(inference_ranks), j)
            shape = [rows.stop - rows.start] + ([cols.stop - cols.start] if p.dim() > 1 else [])
            slices[name] = torch.zeros(shape, dtype=p.dtype, device=device)

    ops, keep_alive = [], []
    for t in plan(model, layout, trainer_ranks, inference_ranks):
        if rank == t.src:
            local = params[t.name].to_local()[t.src_rows]
            piece = (local[:, t.cols] if local.dim() > 1 else local).contiguous()
            keep_alive.append(piece)
            ops.append(dist.P2POp(dist.isend, piece, t.dst))
        elif rank == t.dst:
            ops.append(dist.P2POp(dist.irecv, slices[t.name][t.dst_rows], t.src))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return slices if rank in inference_ranks else None
