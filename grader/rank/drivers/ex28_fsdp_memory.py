"""Exercise 28: after moving to FSDP2 each rank's memory barely drops (the blocks are passed to fully_shard, the
root never is: the embeddings, the final norm and the head stay whole on every rank, and each rank steps them
on its own gradients): the drivers, run in each rank (the checks that decide:
grader/checks/ex28_fsdp_memory.py).

Run the script's main() under torchrun's variables (the track's job runner); at every optimizer step, a hook
of the grader's own records what the rank holds of each parameter the optimizer steps (its local part, DTensor
or not) and of its optimizer state.
"""

from __future__ import annotations

import torch
from torch import nn

from grader.rank import probes
from grader.rank.child import RankContext
from grader.rank.drivers.shared import debug_rank


EPOCHS = 3


def make_data() -> dict:
    return debug_rank.job_tokens(seed=28)


def _names(params: list) -> dict[int, str]:
    """The parameters' names in the largest module that holds them all (found once, among the objects alive)."""
    import gc

    wanted = {id(p) for p in params}
    best: dict[int, str] = {}
    for obj in gc.get_objects():
        if isinstance(obj, nn.Module):
            named = {id(p): name for name, p in obj.named_parameters()}
            if wanted <= named.keys() and len(named) >= len(best):
                best = named
    return best


def _held(optimizer, names: dict[int, str]) -> list[dict]:
    """What this rank holds of each parameter the optimizer steps, and of that parameter's state."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not names:
        names.update(_names(params))
    out = []
    for p in params:
        state = optimizer.state.get(p, {})
        out.append({"name": names.get(id(p), "?"), "shape": list(p.shape), "dtensor": isinstance(p, DTensor),
                    "bytes": local(p).numel() * local(p).element_size(),
                    "state_bytes": sum(local(v).numel() * local(v).element_size() for v in state.values()
                                       if isinstance(v, torch.Tensor))})
    return out


def rank_main(ctx: RankContext) -> dict:
    """The job, with what the rank holds at each optimizer step, and a trace of FSDP's all-gathers with the
    start of each backward and each step (to count the units a forward gathers)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    held: list = []
    trace: list = []
    names: dict[int, str] = {}

    def after_step(optimizer, args, kwargs):
        held.append(_held(optimizer, names))
        trace.append({"what": "step"})

    original_backward = torch.Tensor.backward

    def backward(tensor, *args, **kwargs):
        trace.append({"what": "backward"})
        return original_backward(tensor, *args, **kwargs)

    hook = register_optimizer_step_post_hook(after_step)
    try:
        with probes.patched(torch.Tensor, "backward", backward), probes.watch_collectives(trace):
            record = debug_rank.run_job(ctx, ["--data", debug_rank.write_data(ctx, make_data())], epochs=EPOCHS)
    finally:
        hook.remove()
    record["held"] = held
    record["trace"] = [e for e in trace if e.get("what") or e.get("op") in probes.ALL_GATHERS]
    return record
