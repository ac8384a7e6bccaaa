"""Exercise 51: hide FSDP's communication (prefetch the next unit's all-gather, reduce-scatter under backward).

Exercise 11's FullyShardedDP waits for every collective it issues: each unit's
all-gather starts when the unit is about to run, and the unit waits for it
doing nothing. On real hardware the network and the matmuls run at the same
time, so a trainer starts the next unit's all-gather before this unit
computes and waits for it only when the next unit starts: the transfer hides
under the computation. FSDP2 does this for you (fully_shard prefetches one
unit ahead; set_modules_to_forward_prefetch and set_modules_to_backward_prefetch
name which units, reshard_after_forward whether a unit is freed after its
forward); here you write it by hand.

The grader starts the processes and the process group (gloo on CPU), builds
a model whose direct children are its units (they run once each per
forward, in the order module.children() lists them), and trains with your
class in float64:

    model = PrefetchingFSDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=...)
    for each step:
        out = model(x); loss = mse_loss(out, y)
        loss.backward()
        model.finish_gradient_synchronization()
        optimizer.step(); optimizer.zero_grad()
    model.full_state_dict()

    class PrefetchingFSDP(torch.nn.Module)
        Exercise 11's FullyShardedDP contract (its __init__, forward,
        finish_gradient_synchronization and full_state_dict, the same slices,
        padding and freeing), with the communication overlapped:
        forward
            Just before unit i runs, issue the all-gather of unit i + 1 with
            async_op=True, and wait for it only when unit i + 1 is about to run
            (unit 0's all-gather has nothing before it to hide under).
        backward
            The same in reverse: when the backward of unit i begins, issue the
            all-gather of unit i - 1, and wait for it only when the backward of
            unit i - 1 begins. As soon as a unit's full gradient exists (its
            gradient accumulated into the full buffer), issue its reduce-scatter
            with async_op=True, and wait for it only in
            finish_gradient_synchronization.
        memory
            No more than two units' full parameters in memory at any moment:
            while unit i computes, unit i and the one prefetched. Free each unit
            right after its forward and right after its backward, in place.

Why two and not three: the prefetched unit's buffer must exist while the
current unit computes, so overlap costs one unit's full parameters more than
exercise 11. A third is what prefetching two units ahead needs (FSDP2's
set_modules_to_forward_prefetch with two modules: "more aggressive overlap",
"more reserved memory", its docstring says), or a unit kept after its forward
while the next two are gathered. FSDP2's own prefetching stays one unit ahead
because the CPU can issue the all-gathers of many units in the time the GPU
computes one, each output a unit's full parameters: in forward it keeps the
previous all-gather's output only until the next unit's copy-out, and its
all-gather stream waits for that copy-out before the next all-gather runs
(torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
FSDPParamGroup.wait_for_unshard). The reduce-scatters under backward keep each
unit's full gradient alive until they are waited for; FSDP2 bounds those too
(set_reduce_scatter_max_input_buffers: one buffer in flight by default).

The grader records, on every rank, when each all-gather and reduce-scatter is
issued and waited for, and when each unit's forward and backward begin and
end (the events' order, never their duration: 2 CPU cores show no speedup),
looks for the units' full parameters in memory as each unit runs, and
compares the outputs, the slices' gradients and the trained parameters with
single-process training on the global batch.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/51_prefetch_fsdp.py      (stuck? ddp-grade hint 51)
"""

import math

import torch
import torch.distributed as dist


class PrefetchingFSDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        # TODO: as exercise 11: broadcast from rank 0; per unit, this rank's slice of the flat, padded
        # parameters as an nn.Parameter and an empty full buffer; take the originals away (delattr); then the
        # hooks that wait for a unit's all-gather and prefetch the next one, free it, do the same in reverse
        # in backward, and reduce-scatter each unit's gradient as soon as it is complete.
        raise NotImplementedError

    def forward(self, *args, **kwargs):
        # TODO: run the wrapped module (your hooks gather, prefetch and free each unit around it).
        raise NotImplementedError

    def finish_gradient_synchronization(self):
        # TODO: wait for every reduce-scatter in flight; leave in every slice's .grad the average over ranks.
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        # TODO: the unsharded state, with the original module's keys, on every rank.
        raise NotImplementedError
