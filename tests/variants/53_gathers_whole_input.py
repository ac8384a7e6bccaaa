"""Exercise 53, broken: the textbook tensor-parallel layer, not decomposed: all-gather the whole input, then one
matmul (and one matmul, then reduce-scatter); backward the same way. Right numbers, nothing overlapped, and the
whole gathered input on every rank."""
# expect-fail: never-whole-input ring-traffic
# expect-pass: allgather-matmul-output allgather-matmul-grads matmul-reduce-scatter-output matmul-reduce-scatter-grads
# expect-message: never-whole-input the whole gathered input

import torch
import torch.distributed as dist


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, group):
        size = dist.get_world_size(group)
        gathered = x_shard.new_empty(size * x_shard.shape[0], x_shard.shape[1])
        dist.all_gather_into_tensor(gathered, x_shard.contiguous(), group=group)
        ctx.save_for_backward(gathered, weight)
        ctx.group = group
        return gathered @ weight

    @staticmethod
    def backward(ctx, grad_out):
        gathered, weight = ctx.saved_tensors
        partial = grad_out @ weight.t()
        grad_x = partial.new_empty(partial.shape[0] // dist.get_world_size(ctx.group), partial.shape[1])
        dist.reduce_scatter_tensor(grad_x, partial.contiguous(), group=ctx.group)
        return grad_x, gathered.t() @ grad_out, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_shard, group):
        ctx.save_for_backward(x, weight_shard)
        ctx.group = group
        product = x @ weight_shard
        out = product.new_empty(product.shape[0] // dist.get_world_size(group), product.shape[1])
        dist.reduce_scatter_tensor(out, product, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight_shard = ctx.saved_tensors
        gathered = grad_out.new_empty(x.shape[0], grad_out.shape[1])
        dist.all_gather_into_tensor(gathered, grad_out.contiguous(), group=ctx.group)
        return gathered @ weight_shard.t(), x.t() @ gathered, None


def allgather_matmul(x_shard, weight, group):
    return _AllGatherMatmul.apply(x_shard, weight, group)


def matmul_reduce_scatter(x, weight_shard, group):
    return _MatmulReduceScatter.apply(x, weight_shard, group)
