"""Exercise 20: context parallelism by all-to-all: DeepSpeed-Ulysses.

Exercise 16 kept each rank's queries at home and sent the keys and values around a ring.
DeepSpeed-Ulysses (Jacobs et al., 2023) cuts the other way: attention heads never look at
each other, so for the length of the attention a rank can trade its chunk of the sequence
for a share of the heads. One all-to-all before attention takes q, k and v from
[batch, heads, seq / W, head_dim] (every head, this rank's positions) to
[batch, heads / W, seq, head_dim] (this rank's heads, every position); each rank runs
ordinary attention over the whole sequence for its heads; a second all-to-all brings the
output back to this rank's positions for every head. An all-to-all sends part j of a
rank's tensor to rank j: here part j is rank j's heads. The part a rank keeps is its own,
so (W - 1) / W of each tensor leaves it.

    ulysses_attention(q, k, v, causal=False, group=None) -> Tensor
        q: [batch, heads, seq / W, head_dim]; k, v: [batch, kv_heads, seq / W, head_dim]:
        this rank's chunk of the sequence; rank r (its rank in `group`, the default group
        when None) holds positions [r * seq / W, (r + 1) * seq / W). Returns this rank's
        chunk of softmax(q k^T / sqrt(head_dim)) v over the whole sequence: the shape,
        dtype and device of q. kv_heads divides heads, and query head h attends with
        key/value head h // (heads / kv_heads) (grouped-query attention, paired as torch's
        scaled_dot_product_attention(..., enable_gqa=True) pairs them).
        - Heads: rank r computes query heads [r * heads / W, (r + 1) * heads / W).
          heads not divisible by W: raise ValueError on every rank (every rank sees the
          same shapes, so none needs a message to agree; DeepSpeed's UlyssesSPAttentionHF
          refuses the same). Not an assert: python -O removes asserts.
        - Key/value heads, decided as UlyssesSPAttentionHF decides them: kv_heads
          divisible by W: each rank gets kv_heads / W of them, those its query heads use.
          Fewer key/value heads than ranks (W divisible by kv_heads): repeat each one
          W / kv_heads times along the heads (repeat_interleave) before the all-to-all, so
          that rank r receives copy r, which is head r // (W / kv_heads), the one its
          query heads use; autograd adds up the copies' gradients. Neither divides the
          other: ValueError on every rank.
        - Messages: all-to-alls in `group` only (dist.all_to_all_single, dist.all_to_all,
          or torch.distributed._functional_collectives.all_to_all_single(_autograd)).
          Forward: q, k and v sequence-to-heads (one all-to-all each, or fewer carrying
          several) and the output heads-to-sequence (one). Backward: the mirror image, the
          output's gradient sequence-to-heads and the gradients of q, k and v
          heads-to-sequence. A rank keeps its own part of every tensor it exchanges:
          (W - 1) / W of it leaves the rank. Nothing else is sent (a collective of a few
          numbers is allowed).
        - Memory: a rank never holds the whole sequence of more heads than its own:
          heads / W heads of q (of k and v, kv_heads / W or one), in forward, in what
          autograd keeps for backward, in backward.
        - Gradients: after backward, q.grad, k.grad and v.grad on every rank are the
          matching chunks of single-process attention's gradients. dist.all_to_all_single
          has no backward: wrap it in a torch.autograd.Function whose backward is the
          opposite all-to-all (as DeepSpeed's _SeqAllToAll does), or use the functional
          all_to_all_single_autograd, whose backward is one.
        - causal=True: the query at position i attends to the keys at positions j <= i
          of the whole sequence.

The grader starts the ranks and their process group (gloo on CPU), gives each rank its
chunk of q, k and v (float64), runs forward and backward, compares with attention
computed in one process, and measures what each rank sends and holds.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/20_ulysses.py      (stuck? ddp-grade hint 20)
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def ulysses_attention(q, k, v, causal=False, group=None):
    # TODO: refuse heads the ranks cannot split (ValueError on every rank); copy the key/value heads
    # up to W when there are fewer; exchange q, k and v sequence-to-heads with all-to-alls that have a
    # backward (a torch.autograd.Function whose backward is the opposite exchange); attention over the
    # whole sequence for this rank's heads; exchange the output heads-to-sequence.
    raise NotImplementedError
