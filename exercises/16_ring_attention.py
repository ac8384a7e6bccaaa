"""Exercise 16: context parallelism by hand: ring attention.

A sequence too long for one device can be cut along its length: with context
parallelism each of W ranks holds one contiguous chunk of every activation, and
most layers (linear layers, norms, the MLP) work on their chunk alone. Attention
cannot: every query needs every key. Ring attention (Liu et al., 2023) computes
it without ever gathering the whole sequence on one rank. Each rank keeps its
queries; the key/value blocks travel around a ring of ranks. At each of W steps
a rank multiplies its queries by the block it holds, passes that block on to
rank + 1 and receives the next one from rank - 1 (post the exchange before the
multiplication, and the two overlap).

Softmax over the whole row is assembled from the blocks with the online softmax
(Milakov and Gimelshein, 2018): a block's result is its output normalised over its
own keys, out_b, and the log-sum-exp of its scores, lse_b = log(sum_j exp(s_j)).
Two results over disjoint sets of keys merge exactly:

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

Nothing there overflows: a log-sum-exp is computed after subtracting the row's
largest score (torch.logsumexp does), and exp of a difference of two log-sum-exps
is at most 1.

    ring_attention(q, k, v, causal=False, group=None) -> Tensor
        q, k, v: [batch, heads, seq / W, head_dim], this rank's chunk of the
        sequence; rank r (its rank in `group`, the default group when None)
        holds positions [r * seq / W, (r + 1) * seq / W). Returns this rank's
        chunk of softmax(q k^T / sqrt(head_dim)) v over the whole sequence:
        the same shape, dtype and device as q.
        - Messages: point-to-point only, between ring neighbours in `group`
          (dist.isend / dist.irecv / dist.batch_isend_irecv; `dst` and `src`
          are global ranks, `group_dst` and `group_src` ranks in the group).
          In forward K and V each make W - 1 hops. No collective may carry K,
          V or their gradients; one of a few numbers (such as the ranks'
          chunk lengths) is allowed.
        - Memory: a rank never holds more than two other ranks' key/value
          blocks at once (the one it computes with and the one arriving): not
          in forward, not in what is kept for backward, not in backward.
          Autograd through the ring would keep every block it received, so
          write a torch.autograd.Function that saves only this rank's q, k, v,
          the output and its log-sum-exp. Its backward is a second ring: the
          K/V blocks travel again, and the gradients of each block travel
          with it until they reach the rank that owns it.
        - Gradients: after backward, q.grad, k.grad and v.grad on every rank
          are the matching chunks of single-process attention's gradients.
        - causal=True: the query at position i attends to the keys at
          positions j <= i. Blocks wholly in the future (from a later rank)
          are never computed, in forward or backward: rank r computes r + 1
          blocks. The block of its own chunk is masked within.
        - Stable: the grader multiplies the queries by 1000; no inf or NaN.
        - Chunks of different lengths on different ranks (a sequence not
          divisible by W): raise ValueError on every rank, saying the lengths.

    Optional, graded when it does not raise NotImplementedError:
    zigzag_ring_attention(q, k, v, group=None) -> Tensor
        Causal ring attention, load-balanced. With contiguous chunks the last
        rank computes W blocks and rank 0 one. Cut the sequence into 2W
        chunks instead; rank r holds chunks r and 2W - 1 - r, one after the
        other (q, k, v: [batch, heads, seq / W, head_dim], the output alike).
        Then at every step but the first each rank computes half a block. A
        block from an earlier rank: all of this rank's queries against the
        first half of that block's keys (its second chunk comes after both
        of ours). A block from a later rank: only the second half of this
        rank's queries, against all of that block's keys. Same rules as above.

With gloo a blocking dist.send waits until the receiver has posted its receive:
if every rank sends first, nobody receives. With NCCL, post the sends and
receives of one exchange together, in one dist.batch_isend_irecv.

The grader starts the ranks and their process group (gloo on CPU), gives each
rank its chunk of q, k and v (float64), runs forward and backward, compares
with attention computed in one process, and measures what each rank sends,
holds and multiplies.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/16_ring_attention.py      (stuck? ddp-grade hint 16)
"""

import math

import torch
import torch.distributed as dist


def ring_attention(q, k, v, causal=False, group=None):
    # TODO: refuse chunks of different lengths (ValueError on every rank); then a
    # torch.autograd.Function: its forward passes the K/V blocks around the ring and merges
    # each block's result with a running log-sum-exp, saving only q, k, v, the output and
    # the log-sum-exp; its backward is a second ring that brings each block's gradients home.
    raise NotImplementedError


def zigzag_ring_attention(q, k, v, group=None):
    # TODO (optional): causal ring attention, with rank r holding chunks r and 2W - 1 - r of 2W.
    raise NotImplementedError
