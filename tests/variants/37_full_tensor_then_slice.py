"""Exercise 37, wrong on purpose: the trainer ranks gather each parameter whole with DTensor.full_tensor()
(an all-gather among them, as verl's FSDP engine does before its sync), and the first trainer rank sends
each inference rank its slice of it. The slices are right, but the weights also travel between the trainer
ranks, and every trainer rank holds every parameter whole."""
# expect-fail: trainer-to-inference-only holds-no-whole
# expect-not-checked: slice-bytes
# expect-pass: returns-shards shards-match layout-honoured rank-lists

import torch
import torch.distributed as dist


def push_weights(model, layout, trainer_ranks, inference_ranks):
    me = dist.get_rank()
    I = len(inference_ranks)
    sender = trainer_ranks[0]
    out, works, pieces = {}, [], []
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        style = layout.get(module)
        dim = 0 if style == "colwise" else (1 if style == "rowwise" and leaf == "weight" else None)
        full = p.full_tensor() if me in trainer_ranks else None
        for j, i in enumerate(inference_ranks):
            if dim is None:
                index = tuple(slice(0, s) for s in p.shape)
            else:
                size = p.shape[dim] // I
                index = tuple(slice(j * size, (j + 1) * size) if d == dim else slice(0, s)
                              for d, s in enumerate(p.shape))
            if me == sender:
                pieces.append(full[index].contiguous())
                works.append(dist.isend(pieces[-1], dst=i))
            elif me == i:
                out[name] = torch.empty([sl.stop - sl.start for sl in index], dtype=p.dtype)
                works.append(dist.irecv(out[name], src=sender))
    for w in works:
        w.wait()
    return out if me in inference_ranks else None
