"""Exercise 53: hide tensor parallelism's collectives inside its matmuls (async TP, collective matmul).

With sequence parallelism (exercise 18), a column-parallel layer first
all-gathers the activations that each rank holds a slice of the rows of, then
multiplies them by its columns of the weight; a row-parallel layer multiplies
first and reduce-scatters the products. Either way the collective sits alone
on the critical path: nothing can multiply until the whole input has arrived.
Cut it into steps instead. The gathered input is world_size chunks, one per
rank: multiply the chunk in hand while the next one travels around the ring,
and the transfer hides under the matmul. This is "collective matmul" (Wang et
al., "Overlap Communication with Dependent Computation via Decomposition in
Large Deep Learning Models", ASPLOS 2023), and PyTorch's async tensor
parallelism: torch.distributed._symmetric_memory's _fused_all_gather_matmul
and _fused_matmul_reduce_scatter, which torch.compile substitutes for an
all-gather followed by a matmul (torch._inductor.config._micro_pipeline_tp,
what torchtitan's async TP turns on).

The grader starts the processes and the process group (gloo on CPU) and calls
your functions in float64, on the whole world and on subgroups, then calls
backward on their outputs:

    allgather_matmul(x_shard, weight, group) -> torch.Tensor
        x_shard: [rows, k], this rank's rows of the input; the group's ranks hold
        the input's rows in the order of their ranks in the group. weight: [k, m],
        this rank's own. Returns all_gather(x_shard) @ weight, [world_size * rows, m]:
        every row of the input times this rank's weight.
    matmul_reduce_scatter(x, weight_shard, group) -> torch.Tensor
        x: [world_size * rows, k], all rows, this rank's columns of them.
        weight_shard: [k, m], this rank's rows of the weight. Returns this rank's
        block of rows of the sum over the group of every rank's x @ weight_shard,
        [rows, m] (reduce_scatter of the products, summed).

    Both differentiable: the gradients of x_shard, weight, x and weight_shard
    must be those of the all-gather then matmul (and matmul then reduce-scatter)
    they stand for.

The ring: with g = dist.get_rank(group) and W = dist.get_world_size(group),
send to the group's rank (g + 1) % W and receive from (g - 1) % W. W steps:
at each, issue the transfer of the next step's chunk (dist.isend and
dist.irecv, or dist.batch_isend_irecv), multiply the chunk in hand, and only
then wait for the transfer. allgather_matmul passes the input's chunks along
(the chunk in hand at step s came from the group's rank g - s); matmul_
reduce_scatter passes partial sums along, each rank adding its own product
of the block the sum is for, the last addition on the block's owner. dist.
isend and dist.irecv take global ranks (dst=, src=): dist.get_global_rank(
group, g) turns a group's rank into one (or pass group_dst=, group_src=).

No rank may hold the whole gathered input at any moment, in forward or in
backward: a chunk that has been multiplied and passed on is dropped, and an
autograd.Function saves x_shard and weight only (its backward goes around the
ring again). With two ranks a ring holds both chunks anyway; from three on the
grader looks for the whole input in one tensor, and from four on for more than
two other ranks' chunks at once (nor may matmul_reduce_scatter compute its whole
product x @ weight_shard at once: one block of rows at a time). That is what
saves memory; what saves time is that exactly
(W - 1) / W of the input leaves each rank, to its ring neighbour only, each
transfer in flight while a matmul runs. Where it does not pay: the matmul of
one chunk is W times smaller than the whole one, and below a few hundred rows
a GPU runs it less efficiently than the transfer it hides; on GPUs the
transfers need copy engines or symmetric memory, or they take SMs from the
matmul (the reason for torch's _symmetric_memory).

The grader records, on every rank, each point-to-point and collective call
(when it is issued and when it is waited for, and to whom it sends how many
bytes) and each matmul among them, with what the rank holds at that moment,
and compares the outputs and gradients with the all-gather and reduce-scatter
computed in one process.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/53_async_tp.py      (stuck? ddp-grade hint 53)
"""

import torch
import torch.distributed as dist


def allgather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    # TODO: all_gather(x_shard) @ weight, the chunks passed around the ring, each multiplied while the next
    # travels; differentiable (an autograd.Function whose backward goes around the ring again).
    raise NotImplementedError


def matmul_reduce_scatter(x: torch.Tensor, weight_shard: torch.Tensor, group) -> torch.Tensor:
    # TODO: this rank's block of rows of the sum over the group of x @ weight_shard, partial sums passed around
    # the ring, each rank's own product of a block computed while the sum travels; differentiable.
    raise NotImplementedError
