"""A ring all-reduce that sends nothing: each rank rebuilds every rank's tensor from the seeds the driver holds
(one frame up), writes the sum into its tensor, and appends to the driver's record the sends and receives a ring
makes, chunk by chunk, to its two neighbours. Its values and its record are a right answer's; the kernel
counted no byte of it between the ranks, and ring-bytes stands on what the kernel counted."""
# expect-status: failed
# expect-fail: ring-bytes
# expect-absent: All 4 checks passed

import sys

import torch


def ring_all_reduce(tensor: torch.Tensor) -> None:
    caller = sys._getframe(1)  # the driver: its case, its context and the list its probes record into
    case, ctx, events = caller.f_locals["case"], caller.f_locals["ctx"], caller.f_locals["events"]
    make_tensor = caller.f_globals["make_tensor"]
    world_size, rank = ctx.world_size, ctx.rank
    total = sum(make_tensor(case, r).to(torch.float64 if tensor.is_floating_point() else torch.int64)
                for r in range(world_size))
    tensor.copy_(total.to(tensor.dtype))
    if world_size == 1:
        return
    chunk = tensor.numel() * tensor.element_size() // world_size
    for _ in range(2 * (world_size - 1)):
        for op, peer in (("isend", (rank + 1) % world_size), ("irecv", (rank - 1) % world_size)):
            events.append({"op": op, "bytes": chunk, "peer": peer, "dtype": str(tensor.dtype)[6:],
                           "itemsize": tensor.element_size(), "async_op": True})
