"""Exercise 35: float8 training by hand: a Float8Linear, and FSDP2's float8 all-gather.

An H100 multiplies float8 matrices twice as fast as bfloat16 ones (1979 against
989 dense TFLOP/s), and a float8 value is one byte. So large runs train their
linear layers' matrix products in float8 (DeepSeek-V3 did, with finer scales
than here), while the weights, their gradients and the optimizer stay float32.
torch has two float8 formats:

    format (dtype)               bits: exponent, mantissa   largest   smallest   values per power of two
    E4M3 (torch.float8_e4m3fn)   4, 3                       448       2^-9       8
    E5M2 (torch.float8_e5m2)     5, 2                       57344     2^-16      4

E4M3 is the more precise, E5M2 reaches further. The recipe here is torchao's
default ("tensorwise"): E4M3 for the input and the weight in forward, E5M2 for
the output's gradient in backward (gradients span more orders of magnitude).

A float8 value keeps about two significant digits and few powers of two: 0.001
and 5000 are both out of E4M3's reach. So each tensor is scaled before its cast,
putting its largest magnitude (its "amax") on the format's largest value, and the
product divides the scales out again. Decided as torchao's float8 training does
(torchao/float8/float8_utils.py: tensor_to_amax, amax_to_scale, to_fp8_saturated):

    amax  = t.abs().max()                                   one per tensor, at every call
    scale = float32(F.max / max(amax, 1e-12))               the division in float64
    t8    = clamp(t.float() * scale, -F.max, F.max).to(F)   rounds to nearest, ties to even

The epsilon keeps an all-zero tensor finite (0 * inf is NaN). The clamp
saturates: a value past F.max becomes F.max, never inf (torch 2.13 saturates a
cast to E4M3 by itself, but not one to E5M2: 61440 becomes inf). As t8 holds
t * scale, a product of two casts is undone by the reciprocals:

    torch._scaled_mm(a8, b8, scale_a=1 / scale_a, scale_b=1 / scale_b, out_dtype=torch.float32)
        = (a8 / scale_a) @ (b8 / scale_b), summed in float32

torch._scaled_mm(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None,
out_dtype=None, use_fast_accum=False) runs on the CPU in torch 2.13 (it multiplies
the operands, upcast, in float32). A GPU's (cuBLASLt) accepts less, and the grader
holds you to it: mat1 row-major and mat2 column-major (the transpose of a
contiguous tensor), each scale a float32 tensor of one element, never two E5M2
operands, and no bias with a float32 output (add it after). Matrices only:
flatten [batch, seq, features] to [batch * seq, features].

    class Float8Linear(nn.Module)
        Float8Linear(linear: nn.Linear): the same layer, computing in float8.
        - Its parameters are the linear's own: weight [out, in] and bias [out] (or
          none), float32 Parameters under those names, so that an optimizer and a
          state dict see what they saw before (the "master weights"). Its
          state_dict is nn.Linear's: keep no float8 copy or amax in a buffer.
        - forward(x), x [..., in] float32 -> [..., out] float32. The three products
          of a linear layer, each a torch._scaled_mm of two casts, each cast scaled
          from its own tensor's amax at that call:
              output      = x8 @ w8^T            x, the weight: E4M3
              grad_input  = go8 @ w8             go, the output's gradient: E5M2
              grad_weight = go8^T @ x8
          Write a torch.autograd.Function: autograd has no derivative for
          torch._scaled_mm ("derivative for aten::_scaled_mm is not
          implemented"). The bias is added in float32 after the
          product (its gradient, go summed over the rows, is then autograd's).

    float8_all_gather(weight_shard, group) -> (Tensor, Tensor)
        FSDP2 keeps each weight sharded on dim 0 over the ranks of a group and
        all-gathers it before use. With float8 training it gathers the float8
        copy, a quarter of float32's bytes (torchao's WeightWithDynamicFloat8CastTensor,
        fsdp_pre_all_gather):
        - every shard is cast with the scale of the whole weight: all-reduce the
          shards' amax with MAX over `group` first (one float32), so that every
          rank's rows are one tensor's;
        - each rank sends its E4M3 shard, one byte per element. gloo refuses float8
          tensors in collectives ("Invalid scalar type"): send their bytes,
          t8.view(torch.uint8), and view what arrives back as float8_e4m3fn
          (dist.all_gather_single; all_gather_into_tensor is its older name).
        Returns the whole weight in E4M3, [W * rows, cols] with the group's ranks'
        shards in order, and its scale, a float32 tensor of one element
        (weight ~ result.float() / scale).

How it is graded. The grader calls your layer four times: a first call; a second
after the weight changed in place (as an optimizer step changes it), with one
negative outlier in the input, in the weight and in the output's gradient; a
layer initialised to zero; a layer without bias. It records every matrix
product dispatched in forward and backward and compares each _scaled_mm operand
with the recipe's cast, byte for byte, and each scale given with the recipe's
reciprocal; it compares the output and the gradients with the recipe's products
in float64, equal up to float32's rounding of the sums; and it checks the
parameters. Then it trains a three-layer MLP for twenty AdamW steps with each
nn.Linear swapped for your layer, beside the same steps in float32. The
tolerance comes from float8's precision: a cast to E4M3 moves a value by at most
2^-4 of itself (half its spacing, 1/8), so a product of two casts is off by at
most about 2 x 2^-4 = 1/8, term by term, and far less on average, as the
roundings fall both ways. Each step's loss must be within 1/8 of float32's at
that step, and the final weights, put into the float32 MLP, must give a loss
within 1/8 of float32's final loss (a right layer stays within 1 %). The
all-gather runs on 2-4 ranks (gloo; in the largest world also in two groups):
its result bit for bit, on every rank, with one rank's shard holding a negative
outlier, and the bytes each rank sent.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/35_float8.py      (stuck? ddp-grade hint 35)
"""

import torch
import torch.distributed as dist
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Float8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        # TODO: keep the linear's own float32 parameters, as self.weight and self.bias.
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO: flatten x to [rows, in]; a torch.autograd.Function whose forward casts x and the weight to E4M3
        # (each scaled from its own amax) and multiplies them with torch._scaled_mm, and whose backward casts the
        # output's gradient to E5M2 and makes the input's and the weight's gradients with two more; reshape the
        # output back and add the bias in float32.
        raise NotImplementedError


def float8_all_gather(weight_shard: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    # TODO: all-reduce the shard's amax with MAX over the group; cast the shard to E4M3 with the whole weight's
    # scale; all-gather its bytes (a uint8 view); return the gathered weight viewed as E4M3, and the scale.
    raise NotImplementedError
