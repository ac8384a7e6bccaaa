"""Exercise 17: expert parallelism by hand: a mixture of experts over all-to-all.

A mixture-of-experts (MoE) layer replaces one MLP with E of them, the experts, and a
router that sends each token to a few of them (Shazeer et al., 2017; GShard; the Switch
Transformer). The experts hold most of the parameters, and each token uses only top_k
of them. With expert parallelism each of W ranks keeps E / W experts; every rank routes
its own tokens, sends each one to the ranks of its experts with an all-to-all, runs its
own experts on what arrives, and sends the results back with a second all-to-all. How
many rows go from each rank to each other rank changes every step, so the ranks first
exchange their counts (an all-to-all of a few integers) and then use uneven split sizes.

    ExpertParallelMoE(router, experts, top_k, capacity_factor, group=None) -> nn.Module
        router: nn.Linear(d, E), the same on every rank (replicated, not sharded).
        experts: a list of E modules, each [n, d] -> [n, d] row by row, the same on every
        rank. Rank r (its rank in `group`, the default group when None) owns experts
        r * E / W ... (r + 1) * E / W - 1: keep those modules themselves (not copies: the
        grader reads their .grad) and no reference to the others. E not divisible by W:
        raise ValueError, on every rank, before any message.

    forward(x) -> (y, aux_loss)
        x: [tokens, d], this rank's tokens (different on every rank); anything else (not
        2-D, or not d columns): raise ValueError. y: [tokens, d], aux_loss: a scalar.
        1. Route: probs = softmax(router(x)) over the E experts; each token's top_k
           experts, best first; their probabilities renormalised to sum to one: the gates.
        2. Capacity: each expert accepts at most C = ceil(capacity_factor * tokens * top_k / E)
           assignments from each sending rank (tokens: this rank's count): first every
           token's first choice, in token order, then every token's second choice, in token
           order, and so on; the assignments past C are dropped. A dropped assignment
           contributes zero (the token's other gates keep their values).
        3. y[t] = sum over t's kept assignments (t, e) of gate(t, e) * expert_e(x[t]).
        4. aux_loss = E * sum_i f_i * P_i, the Switch Transformer's load-balancing loss over
           this rank's tokens: f_i the fraction of this rank's tokens * top_k choices that
           picked expert i (before any is dropped), P_i the mean of probs[:, i]. It needs no
           message.
        - Messages: the counts first (integers: how many rows each rank receives); then
          exactly two all-to-alls of floating-point data per forward, with uneven split
          sizes (dist.all_to_all_single's input_split_sizes and output_split_sizes): one row
          of x for each kept assignment, to its expert's rank, and the expert's output row
          back. Rows for this rank's own experts may stay home. Nothing else of x's size
          travels: no all-gather or broadcast of the batch, and the gates stay home (apply
          them when the results come back).
        - Backward: both all-to-alls carry gradients back (two all-to-alls per backward),
          so x.grad, the router's gradients (from this rank's tokens alone) and each
          expert's gradients on its owner (summed over every rank's tokens) equal those of
          the same layer computed in one process. dist.all_to_all_single is not
          differentiable: write a torch.autograd.Function whose backward is the all-to-all
          with the split sizes swapped (or use torch.distributed.nn.functional.all_to_all_single).

The grader starts the ranks and their process group (gloo on CPU), builds the same router
and E = 12 experts on every rank (float64), gives each rank its own tokens, runs forward
and backward of sum(y * G) + 0.5 * aux_loss, compares with the same layer computed in one
process, and measures what each rank holds and sends: a random router, one with a tight
capacity, one biased so that one expert gets most tokens, and bad input.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/17_expert_parallel.py      (stuck? ddp-grade hint 17)
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, top_k, capacity_factor, group=None):
        super().__init__()
        # TODO: refuse E not divisible by the world size (ValueError); keep the router, and
        # of the experts only this rank's E / W (the modules themselves, in an nn.ModuleList).
        raise NotImplementedError

    def forward(self, x):
        # TODO: refuse an x that is not [tokens, d]; route (softmax, top_k, renormalise);
        # the aux loss; drop what exceeds each expert's capacity (first choices before second
        # ones, in token order); exchange the counts; all-to-all the kept rows to their experts'
        # ranks, run this rank's experts, all-to-all the results back (both differentiable);
        # weight them by their gates and add them up per token. Return (y, aux_loss).
        raise NotImplementedError
