"""Exercise 11: shard the parameters too (fully sharded data parallel, ZeRO stage 3).

ZeRO stage 1 (exercise 10) split the optimizer state, but every rank still
keeps every parameter and every gradient. Fully sharded data parallel splits
those as well: between steps each rank holds only a 1/world_size slice of
the parameters. A layer's full parameters exist only while that layer
computes: gathered from every rank's slice just before it runs, freed right
after, and gathered once more in backward when its gradients are computed.
The gradients leave backward the same way: each rank receives only the
average of its own slice (a reduce-scatter, half the traffic of an all-reduce).

The grader starts the processes (with RANK, LOCAL_RANK and WORLD_SIZE set, as
torchrun sets them) and the process group (gloo on CPU), and trains with your
class, in float32 and in float64:

    model = FullyShardedDP(net)        # net's direct children are the units
    optimizer = torch.optim.AdamW(model.parameters(), ...)   # or SGD
    for each step:
        loss = mse_loss(model(x), y)
        loss.backward()
        model.finish_gradient_synchronization()
        optimizer.step(); optimizer.zero_grad()
    model.full_state_dict()

    class FullyShardedDP(torch.nn.Module)
        __init__(self, module)
            - Every rank starts from rank 0's parameters and buffers (the
              ranks' modules are built differently on purpose).
            - A unit is a direct child of `module` (module.children()); every
              parameter of `module` lives in one. Each unit runs once per
              forward, takes one tensor and returns one tensor.
            - For each unit, flatten its parameters that require grad (nested
              ones too, as unit.named_parameters() lists them; they share one
              dtype) into one buffer, pad it with zeros to the next multiple of
              the world size, and keep this rank's slice of it (rank r keeps
              elements [r * n, (r + 1) * n), n = padded size / world size) as
              an nn.Parameter of this module: self.parameters() yields these
              slices, and they are what the optimizer steps.
            - Take the unit's original trainable parameters away (delattr),
              so that no full copy survives; while the unit runs, point those
              attribute names at views of the gathered buffer.
            - A parameter with requires_grad=False stays as it is, whole on
              every rank, like a buffer: after the broadcast from rank 0 it
              is neither trained nor communicated.
        forward(self, *args, **kwargs)
            Run the wrapped module. Just before a unit runs, all-gather its
            buffer from the slices (one all-gather per unit); just after, free
            it. In backward, gather it again before that unit's gradients are
            computed, and free it once they are. No more than two units'
            full parameters may be in memory at any moment.
        finish_gradient_synchronization(self)
            Called after loss.backward(): leave in every slice's .grad the
            average over the ranks of the gradient of that slice. One
            reduce-scatter per unit (never an all-reduce: no rank needs the
            other slices' gradients).
        full_state_dict(self) -> dict[str, torch.Tensor]
            The unsharded state with the keys and shapes of the original
            module's state_dict() (frozen parameters and buffers included),
            on every rank.

Freeing means that the memory goes away, not only a name. Autograd keeps a
reference to every tensor it saves for backward (a Linear saves its weight),
so dropping your own reference frees nothing before backward has run. Free a
buffer where it stands with `buf.untyped_storage().resize_(0)`; before filling
it again, `resize_(buf.numel() * buf.element_size())`: every view of it, those
autograd saved included, then sees the new values. Fill it through `buf.data`
(the same memory, without autograd's version counter), or autograd refuses the
views it saved: "modified by an inplace operation".

The grader counts the collectives of each step (all-gathers of a unit's padded
size, reduce-scatters of a slice's size), measures what each rank holds
between steps, and looks for full parameters in memory while each unit runs.
`dist.all_gather_single` and `dist.reduce_scatter_single` are torch 2.13's
names for all_gather_into_tensor and reduce_scatter_tensor; either works.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/11_fsdp.py      (stuck? ddp-grade hint 11)
"""

import math

import torch
import torch.distributed as dist


class FullyShardedDP(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        # TODO: broadcast every parameter and buffer from rank 0; for each unit (a direct
        # child of module): flatten its trainable parameters, pad to a multiple of the world
        # size, keep this rank's slice as an nn.Parameter, take the originals away (delattr),
        # and register the hooks that gather, free and reduce-scatter.
        raise NotImplementedError

    def forward(self, *args, **kwargs):
        # TODO: run the wrapped module (your hooks gather and free each unit around it).
        raise NotImplementedError

    def finish_gradient_synchronization(self):
        # TODO: leave in every slice's .grad the average over ranks of its gradient.
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        # TODO: the unsharded state, with the original module's keys, on every rank.
        raise NotImplementedError
