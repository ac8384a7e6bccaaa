"""Exercise 16, wrong on purpose: the chunk lengths are compared through their sum: a rank raises when the total
is not W times its own length. With lengths 3, 5, 4, 4 the ranks holding 4 find 16 = 4 x 4, go on into the ring, and
wait alone there while the others have refused."""
# expect-fail: uneven-refused
# expect-pass: matches-attention grads-match

import math

import torch
import torch.distributed as dist


def check_lengths(q, group):
    """The sequence is W chunks of this rank's length when the lengths agree."""
    length = q.shape[-2]
    total = torch.tensor([length], device=q.device)
    dist.all_reduce(total, group=group)
    world_size = dist.get_world_size(group)
    if int(total) != length * world_size:
        raise ValueError(f"the sequence of {int(total)} positions is not {world_size} chunks of {length}")


def ring_exchange(tensors, group):
    """Send each tensor to the next rank and receive the previous rank's into new buffers.
    Returns the requests (wait on them before using the buffers) and the buffers."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1:
        return [], tensors  # a ring of one: what would arrive is what we hold
    send_to, recv_from = (rank + 1) % world_size, (rank - 1) % world_size
    received = [torch.empty_like(t) for t in tensors]
    # One batch: NCCL starts its sends and receives together. With two ranks both neighbours are
    # the same rank, and separate isends and irecvs on that pair could wait for each other.
    operations = [dist.P2POp(dist.isend, t, group=group, group_peer=send_to) for t in tensors]
    operations += [dist.P2POp(dist.irecv, t, group=group, group_peer=recv_from) for t in received]
    return dist.batch_isend_irecv(operations), received


def block_pairs(step, rank, world_size, length, causal, zigzag):
    """Which of this rank's query rows meet which rows of the block held at `step`, and whether
    the causal mask applies. The block held at `step` is rank (rank - step)'s."""
    source = (rank - step) % world_size
    every = slice(None)
    if not causal:
        return [(every, every, False)]
    if source == rank:
        return [(every, every, True)]
    if not zigzag:
        # A later rank's block is wholly in the future: never computed.
        return [(every, every, False)] if source < rank else []
    first_half, second_half = slice(0, length // 2), slice(length // 2, None)
    if source < rank:
        return [(every, first_half, False)]  # its second chunk lies after both of ours
    return [(second_half, every, False)]  # both its chunks lie between our two


def block_attention(q, k, v, scale, masked):
    """Softmax attention of q over one block of keys: the output normalised over this block, and the
    log-sum-exp of the scores."""
    scores = q @ k.transpose(-2, -1) * scale
    if masked:
        scores = scores.masked_fill(causal_mask(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # subtracts the row's maximum first
    return torch.exp(scores - lse) @ v, lse


def causal_mask(scores):
    """True above the diagonal: the keys in each query's future (both chunks in the same order)."""
    rows, cols = scores.shape[-2:]
    return torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)


def merge(out, lse, block_out, block_lse):
    """Two softmaxes over disjoint sets of keys, merged into the softmax over both."""
    new_lse = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - new_lse) * out + torch.exp(block_lse - new_lse) * block_out, new_lse


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, group, zigzag):
        check_lengths(q, group)
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)

        k_block, v_block = k, v
        for step in range(world_size):
            if step < world_size - 1:  # post the next exchange first: it runs while this block computes
                requests, (k_next, v_next) = ring_exchange([k_block, v_block], group)
            for rows, cols, masked in block_pairs(step, rank, world_size, q.shape[-2], causal, zigzag):
                block_out, block_lse = block_attention(q[..., rows, :], k_block[..., cols, :],
                                                       v_block[..., cols, :], scale, masked)
                out[..., rows, :], lse[..., rows, :] = merge(out[..., rows, :], lse[..., rows, :],
                                                             block_out, block_lse)
            if step < world_size - 1:
                for request in requests:
                    request.wait()
                k_block, v_block = k_next, v_next

        # Only this rank's own tensors: the other blocks come round again in backward.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group, ctx.zigzag = causal, group, zigzag
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        scale = 1.0 / math.sqrt(q.shape[-1])
        # The softmax's backward needs sum_j dO_ij * O_ij per query row, the same for every block.
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        grad_q = torch.zeros_like(q)

        k_block, v_block = k, v
        grad_k_block, grad_v_block = torch.zeros_like(k), torch.zeros_like(v)
        for step in range(world_size):
            if step < world_size - 1:
                requests, (k_next, v_next) = ring_exchange([k_block, v_block], group)
            for rows, cols, masked in block_pairs(step, rank, world_size, q.shape[-2], ctx.causal, ctx.zigzag):
                q_rows, k_cols, v_cols = q[..., rows, :], k_block[..., cols, :], v_block[..., cols, :]
                scores = q_rows @ k_cols.transpose(-2, -1) * scale
                if masked:
                    scores = scores.masked_fill(causal_mask(scores), float("-inf"))
                probs = torch.exp(scores - lse[..., rows, :])  # the final softmax, recomputed for this block
                grad_v_block[..., cols, :] += probs.transpose(-2, -1) @ grad_out[..., rows, :]
                grad_probs = grad_out[..., rows, :] @ v_cols.transpose(-2, -1)
                grad_scores = probs * (grad_probs - delta[..., rows, :]) * scale
                grad_q[..., rows, :] += grad_scores @ k_cols
                grad_k_block[..., cols, :] += grad_scores.transpose(-2, -1) @ q_rows
            # The block's gradients go on with it; after W hops they reach the rank that owns it.
            grad_requests, (grad_k_block, grad_v_block) = ring_exchange([grad_k_block, grad_v_block], group)
            if step < world_size - 1:
                for request in requests:
                    request.wait()
                k_block, v_block = k_next, v_next
            for request in grad_requests:
                request.wait()
        return grad_q, grad_k_block, grad_v_block, None, None, None


def ring_attention(q, k, v, causal=False, group=None):
    return RingAttention.apply(q, k, v, causal, group, False)


def zigzag_ring_attention(q, k, v, group=None):
    return RingAttention.apply(q, k, v, True, group, True)
