"""Never makes a process group: patches torch.distributed so that the grader's own calls in the rank see a
joined group and the right all-reduce sum, and sends no byte. The sum each rank reports is right; the kernel
counted nothing between the ranks, so collective-works fails."""
# expect-status: failed
# expect-fail: collective-works

import torch.distributed as dist

STATE = {"joined": False}


def setup_ddp(rank, world_size, backend="gloo"):
    STATE.update(joined=True, rank=rank, world_size=world_size, backend=backend or "gloo")
    dist.is_initialized = lambda: STATE["joined"]
    dist.get_rank = lambda group=None: STATE["rank"]
    dist.get_world_size = lambda group=None: STATE["world_size"]
    dist.get_backend = lambda group=None: STATE["backend"]
    n = world_size
    dist.all_reduce = lambda tensor, *args, **kwargs: tensor.fill_(n * (n + 1) / 2)


def cleanup_ddp():
    STATE["joined"] = False
