"""Exercise 35, written the way torchao's float8 training is: Float8Linear is an nn.Linear built on the meta
device and handed the linear's own Parameters (Float8Linear.from_float), the casts go through helpers named
after torchao's (tensor_to_amax, amax_to_scale, to_fp8_saturated), the autograd function saves the float32
input and weight and casts them again in backward (matmul_with_hp_or_float8_args does), and the all-gather
uses the list form of all_gather and concatenates."""

import torch
import torch.distributed as dist
from torch import nn

e4m3_dtype = torch.float8_e4m3fn
e5m2_dtype = torch.float8_e5m2
EPS = 1e-12


@torch.no_grad()
def tensor_to_amax(x):
    return torch.max(torch.abs(x))


@torch.no_grad()
def amax_to_scale(amax, float8_dtype):
    amax = amax.to(torch.float64)
    res = torch.finfo(float8_dtype).max / torch.clamp(amax, min=EPS)
    return res.to(torch.float32)


def to_fp8_saturated(x, float8_dtype):
    max_value = torch.finfo(float8_dtype).max
    return x.clamp(min=-max_value, max=max_value).to(float8_dtype)


def hp_tensor_to_float8(hp_tensor, float8_dtype):
    """(data, scale): data * (1 / scale) ~ hp_tensor."""
    scale = amax_to_scale(tensor_to_amax(hp_tensor), float8_dtype)
    return to_fp8_saturated(hp_tensor.to(torch.float32) * scale, float8_dtype), scale


def addmm_float8_unwrapped(a_data, a_scale, b_data, b_scale):
    # cuBLASLt: a row-major, b column-major; the scales given are the inverses.
    if not a_data.is_contiguous():
        a_data = a_data.contiguous()
    if b_data.is_contiguous():
        b_data = b_data.t().contiguous().t()
    return torch._scaled_mm(a_data, b_data, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                            out_dtype=torch.float32)


class matmul_with_hp_or_float8_args(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_hp, weight_hp_t):
        ctx.save_for_backward(input_hp, weight_hp_t)
        input_data, input_scale = hp_tensor_to_float8(input_hp, e4m3_dtype)
        weight_data_t, weight_scale = hp_tensor_to_float8(weight_hp_t, e4m3_dtype)
        orig_shape = input_hp.shape
        res = addmm_float8_unwrapped(input_data.reshape(-1, orig_shape[-1]), input_scale, weight_data_t, weight_scale)
        return res.reshape(*orig_shape[:-1], res.shape[-1])

    @staticmethod
    def backward(ctx, grad_output):
        input_hp, weight_hp_t = ctx.saved_tensors
        grad_output_reshaped = grad_output.reshape(-1, grad_output.shape[-1])
        go_data, go_scale = hp_tensor_to_float8(grad_output_reshaped, e5m2_dtype)
        weight_data_t, weight_scale = hp_tensor_to_float8(weight_hp_t, e4m3_dtype)
        grad_input = addmm_float8_unwrapped(go_data, go_scale, weight_data_t.t(), weight_scale)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1])
        input_reshaped = input_hp.reshape(-1, input_hp.shape[-1])
        input_data, input_scale = hp_tensor_to_float8(input_reshaped, e4m3_dtype)
        grad_weight = addmm_float8_unwrapped(go_data.t(), go_scale, input_data, input_scale)
        return grad_input, grad_weight.t()


class Float8Linear(nn.Linear):
    def __init__(self, mod: nn.Linear):
        with torch.device("meta"):
            super().__init__(mod.in_features, mod.out_features, bias=False)
        self.weight = mod.weight
        self.bias = mod.bias

    @classmethod
    def from_float(cls, mod):
        return cls(mod)

    def forward(self, input):
        output = matmul_with_hp_or_float8_args.apply(input, self.weight.t())
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output


def float8_all_gather(weight_shard, group):
    amax = tensor_to_amax(weight_shard).to(torch.float32)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = amax_to_scale(amax, e4m3_dtype)
    data = to_fp8_saturated(weight_shard.detach().to(torch.float32) * scale, e4m3_dtype)
    outputs = [torch.empty_like(data.view(torch.uint8)) for _ in range(dist.get_world_size(group))]
    dist.all_gather(outputs, data.view(torch.uint8).contiguous(), group=group)
    return torch.cat(outputs).view(e4m3_dtype), scale
