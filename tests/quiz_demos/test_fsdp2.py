"""Demonstrations for the quiz topic 'fsdp2' (grader/quiz/bank/fsdp2.toml).

FSDP2 as production code uses it (MixedPrecisionPolicy, reshard_after_forward, clipping DTensor
gradients) on two gloo ranks on CPU, in one world (module fixture).
"""

from __future__ import annotations

import math

import pytest
import torch
from quiz_demos.world import run_world
from torch import nn

pytestmark = pytest.mark.slow


class Tiny(nn.Module):
    """Embeddings, three blocks and a head: the root keeps the embeddings and the head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 10)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _tiny():
    torch.manual_seed(0)
    return Tiny()


def _shard(model, mesh, policy, last_block_reshards=True, root=True):
    from torch.distributed.fsdp import fully_shard

    for i, block in enumerate(model.layers):
        fully_shard(block, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=last_block_reshards or i < len(model.layers) - 1)
    if root:
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def fsdp2_main(ctx) -> dict:
    with ctx.group():
        return fsdp2_observations(ctx.rank, ctx.world_size)


def fsdp2_observations(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    out = {}
    mesh = init_device_mesh("cpu", (world_size,))
    tokens = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(rank))
    seen = []  # (collective, dtype) of every all-gather and reduce-scatter FSDP makes
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def recording(name):
        def call(*args, **kwargs):
            output = kwargs.get("output", args[0] if args else None)
            seen.append((name, str(output.dtype).removeprefix("torch.")))
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, recording(name))
    try:
        # reduce_dtype left out: the reduction runs in param_dtype; the sharded gradient is float32.
        for label, policy in (("bf16_only", MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
                              ("bf16_fp32", MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                 reduce_dtype=torch.float32))):
            model = _shard(_tiny(), mesh, policy)
            computed = []
            model.head.register_forward_pre_hook(
                lambda module, args, into=computed: into.append(str(module.weight.dtype)))
            seen.clear()
            model(tokens).float().sum().backward()
            out[label] = {
                "reduce_dtypes": sorted({d for n, d in seen if n == "reduce_scatter_single"}),
                "gather_dtypes": sorted({d for n, d in seen if n == "all_gather_single"}),
                "grad_dtype": str(model.head.weight.grad.dtype).removeprefix("torch."),
                "param": (type(model.head.weight).__name__, str(model.head.weight.dtype).removeprefix("torch.")),
                "computed_with": computed,
            }

        # All-gathers of one step: every block (reshard after forward) twice, the root once.
        fp32 = MixedPrecisionPolicy()
        for label, last in (("default", True), ("last_block_kept", False)):
            model = _shard(_tiny(), mesh, fp32, last_block_reshards=last)
            seen.clear()
            model(tokens).sum().backward()
            out[f"gathers_{label}"] = sum(1 for n, _ in seen if n == "all_gather_single")
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)

    # Clipping DTensor gradients: the norm over every rank's shards, as a replicated DTensor.
    model = _shard(_tiny(), mesh, MixedPrecisionPolicy())
    model(tokens).sum().backward()
    local_squares = sum(float(p.grad.to_local().double().pow(2).sum()) for p in model.parameters())
    squares = torch.tensor([local_squares], dtype=torch.float64)
    dist.all_reduce(squares)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # measures, clips nothing
    out["clip"] = {"type": type(total).__name__, "placements": [repr(p) for p in total.placements],
                   "value": float(total.full_tensor()), "all_shards": math.sqrt(float(squares)),
                   "own_shards": math.sqrt(local_squares)}
    # to_local() is a view of the gradient's shard: scaling it in place scales the DTensor's gradient.
    grad = model.head.weight.grad
    before = grad.full_tensor().clone()
    grad.to_local().mul_(2.0)
    out["to_local_is_a_view"] = torch.equal(grad.full_tensor(), 2 * before)
    out["grad_is_dtensor"] = isinstance(grad, DTensor)

    # The root left out: the head, a float32 Linear, meets the last block's bfloat16 output.
    model = _shard(_tiny(), mesh, MixedPrecisionPolicy(param_dtype=torch.bfloat16), root=False)
    try:
        model(tokens)
        out["root_left_out"] = "ran"
    except RuntimeError as exc:
        out["root_left_out"] = f"RuntimeError: {exc}"
    # In float32 the same model runs: the root's embeddings and head are plain tensors, whole on every
    # rank, and their gradients come from this rank's tokens alone (each rank has its own).
    model = _shard(_tiny(), mesh, MixedPrecisionPolicy(), root=False)
    model(tokens).sum().backward()
    root_params = {"emb": model.emb.weight, "head": model.head.weight}
    out["root_left_out_params"] = {name: (isinstance(p, DTensor), list(p.shape)) for name, p in root_params.items()}
    out["root_left_out_block_param"] = isinstance(model.layers[0][0].weight, DTensor)
    out["root_left_out_grads"] = {name: p.grad.clone() for name, p in root_params.items()}
    return out


@pytest.fixture(scope="module")
def fsdp2(session):
    return run_world(session, "quiz_demos.test_fsdp2:fsdp2_main", 2, timeout_s=180)


def test_reduce_dtype_defaults_to_param_dtype_and_the_sharded_gradient_keeps_the_parameters_dtype(fsdp2):
    for seen in fsdp2:
        assert seen["bf16_only"]["reduce_dtypes"] == ["bfloat16"]
        assert seen["bf16_fp32"]["reduce_dtypes"] == ["float32"]
        assert seen["bf16_only"]["grad_dtype"] == seen["bf16_fp32"]["grad_dtype"] == "float32"


def test_param_dtype_casts_the_gathered_copy_and_the_sharded_parameter_stays_float32(fsdp2):
    for seen in fsdp2:
        for label in ("bf16_only", "bf16_fp32"):
            assert seen[label]["gather_dtypes"] == ["bfloat16"]
            assert seen[label]["computed_with"] == ["torch.bfloat16"]
            assert seen[label]["param"] == ("DTensor", "float32")


def test_a_step_gathers_each_resharded_block_twice_and_the_root_once(fsdp2):
    for seen in fsdp2:
        assert seen["gathers_default"] == 4 + 3  # forward: root and 3 blocks; backward: the 3 blocks again
        assert seen["gathers_last_block_kept"] == 4 + 2


def test_clip_grad_norm_on_dtensor_gradients_returns_the_norm_over_every_ranks_shards(fsdp2):
    values = []
    for seen in fsdp2:
        clip = seen["clip"]
        assert clip["type"] == "DTensor" and clip["placements"] == ["Replicate()"]
        assert math.isclose(clip["value"], clip["all_shards"], rel_tol=1e-5)
        assert clip["own_shards"] < clip["all_shards"]
        values.append(clip["value"])
    assert values[0] == values[1]


def test_to_local_is_a_view_of_the_gradients_shard(fsdp2):
    for seen in fsdp2:
        assert seen["grad_is_dtensor"] and seen["to_local_is_a_view"]


def test_a_root_left_out_of_fully_shard_meets_bfloat16_activations_with_float32_weights(fsdp2):
    for seen in fsdp2:
        assert seen["root_left_out"].startswith("RuntimeError")
        assert "dtype" in seen["root_left_out"]


def test_a_root_left_out_keeps_whole_unsynchronised_embeddings_and_head(fsdp2):
    for seen in fsdp2:
        assert seen["root_left_out_block_param"] is True  # the blocks are sharded DTensors
        assert seen["root_left_out_params"] == {"emb": (False, [10, 8]), "head": (False, [10, 8])}
    # Two ranks with different tokens: without a reduce-scatter the root's gradients stay different.
    for name in ("emb", "head"):
        assert not torch.allclose(fsdp2[0]["root_left_out_grads"][name], fsdp2[1]["root_left_out_grads"][name])
