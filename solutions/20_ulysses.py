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

Grade it with:  ddp-grade exercises/20_ulysses.py      (stuck? ddp-grade hint 20)
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def check_heads(heads, kv_heads, world_size):
    """Every rank has the same shapes, so every rank raises here, before any message."""
    if heads % world_size:
        raise ValueError(f"{heads} attention heads cannot be split evenly over {world_size} ranks")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"{kv_heads} key/value heads over {world_size} ranks: neither divides the other")


def sequence_to_heads(x, group):
    """[batch, heads, seq / W, head_dim] -> [batch, heads / W, seq, head_dim]."""
    world_size = dist.get_world_size(group)
    batch, heads, chunk, head_dim = x.shape
    # all_to_all_single sends slice j of dim 0 to rank j: put rank j's heads there.
    send = x.reshape(batch, world_size, heads // world_size, chunk, head_dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # received[j] is rank j's chunk of the sequence for this rank's heads: line the chunks up.
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world_size, world_size * chunk, head_dim)


def heads_to_sequence(x, group):
    """[batch, heads / W, seq, head_dim] -> [batch, heads, seq / W, head_dim]."""
    world_size = dist.get_world_size(group)
    batch, local_heads, seq, head_dim = x.shape
    send = x.reshape(batch, local_heads, world_size, seq // world_size, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # received[j] is rank j's heads for this rank's chunk: heads in rank order.
    return received.transpose(0, 1).reshape(batch, world_size * local_heads, seq // world_size, head_dim)


class SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(grad, ctx.group), None


class HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(grad, ctx.group), None


def ulysses_attention(q, k, v, causal=False, group=None):
    world_size = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    check_heads(heads, kv_heads, world_size)

    if kv_heads < world_size:
        # Fewer key/value heads than ranks: copy r of the repeated heads goes to rank r.
        k = k.repeat_interleave(world_size // kv_heads, dim=1)
        v = v.repeat_interleave(world_size // kv_heads, dim=1)

    q, k, v = (SequenceToHeads.apply(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return HeadsToSequence.apply(out, group)
