"""Demonstrations for the quiz topic 'dtensor' (grader/quiz/bank/dtensor.toml).

DeviceMesh and DTensor as tensor parallelism uses them: a 2-D mesh's sub-groups, the placements the
parallel styles give a Linear's weight, what a styled module returns, the collective a row-parallel
layer's output layout costs, uneven shards, and FSDP2 over a tensor-parallel plan. Four gloo ranks on
CPU, one world (module fixture).
"""

from __future__ import annotations

import pytest
import torch
from quiz_demos.world import run_world
from torch import nn

pytestmark = pytest.mark.slow


def dtensor_main(ctx) -> dict:
    with ctx.group():
        return dtensor_observations(ctx.rank, ctx.world_size)


def _linear(d_in: int, d_out: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(d_in, d_out, bias=bias)


def dtensor_observations(rank: int, world_size: int) -> dict:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    out["tp_group"] = tp.mesh.tolist()
    out["dp_group"] = mesh["dp"].mesh.tolist()

    # The placements of a Linear's weight ([out_features, in_features]) under each style.
    col = parallelize_module(_linear(8, 6, bias=True), tp, ColwiseParallel())
    row = parallelize_module(_linear(8, 6, bias=True), tp, RowwiseParallel())
    out["colwise"] = {"weight": [repr(p) for p in col.weight.placements], "local": list(col.weight.to_local().shape),
                      "bias": [repr(p) for p in col.bias.placements]}
    out["rowwise"] = {"weight": [repr(p) for p in row.weight.placements], "local": list(row.weight.to_local().shape),
                      "bias": [repr(p) for p in row.bias.placements]}

    # What a column-parallel module returns by default, and with use_local_output=False.
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    y = col(x)
    kept = parallelize_module(_linear(8, 6), tp, ColwiseParallel(use_local_output=False))(x)
    out["colwise_output"] = {"type": type(y).__name__, "shape": list(y.shape),
                             "kept": (type(kept).__name__, [repr(p) for p in kept.placements], list(kept.shape))}

    # The collective a row-parallel layer's output layout costs.
    from grader.rank.probes import FUNCTIONAL_COLLECTIVES  # each functional collective's name, by the op it is

    seen = []
    originals = {name: getattr(funcol, name) for name in FUNCTIONAL_COLLECTIVES if hasattr(funcol, name)}

    def recording(name):
        def call(*args, **kwargs):
            if not depth:  # the outermost call only
                seen.append(FUNCTIONAL_COLLECTIVES[name])
            depth.append(name)
            try:
                return originals[name](*args, **kwargs)
            finally:
                depth.pop()
        return call

    depth = []
    for name in originals:
        setattr(funcol, name, recording(name))
    try:
        h = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
        local_h = h.chunk(2, dim=-1)[tp.get_local_rank()]
        for label, layouts in (("replicate", Replicate()), ("sequence", Shard(1))):
            layer = parallelize_module(_linear(8, 6), tp, RowwiseParallel(output_layouts=layouts))
            seen.clear()
            result = layer(local_h)
            out[f"rowwise_to_{label}"] = {"collectives": list(seen), "shape": list(result.shape)}
        # to_local is this rank's piece, no communication; full_tensor gathers.
        d = distribute_tensor(torch.arange(10.0).reshape(5, 2), tp, [Shard(0)])
        seen.clear()
        d.to_local()
        after_local = list(seen)
        d.full_tensor()
        out["to_local_vs_full"] = {"to_local": after_local, "full_tensor": list(seen)[len(after_local):]}
    finally:
        for name, original in originals.items():
            setattr(funcol, name, original)
    # Uneven: 5 rows on 2 ranks split as torch.chunk does.
    out["uneven_rows"] = list(d.to_local().shape)

    # SequenceParallel on a norm: the weight replicated, the norm run on a slice of the sequence.
    norm = parallelize_module(nn.RMSNorm(8), tp, SequenceParallel())
    seq = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(3))
    normed = norm(seq.chunk(2, dim=1)[tp.get_local_rank()])
    out["sequence_parallel"] = {"weight": [repr(p) for p in norm.weight.placements],
                                "out": (type(normed).__name__, [repr(p) for p in normed.placements],
                                        list(normed.to_local().shape))}

    # FSDP2 over "dp" after the plan: the parameter lives on the 2-D mesh.
    model = nn.Sequential(_linear(8, 8), nn.ReLU(), _linear(8, 8))
    parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    weight = model[0].weight
    out["two_d"] = {"type": type(weight).__name__, "mesh": list(weight.device_mesh.mesh_dim_names),
                    "placements": [repr(p) for p in weight.placements], "local": list(weight.to_local().shape),
                    "dtensor": isinstance(weight, DTensor)}
    return out


@pytest.fixture(scope="module")
def dtensor(session):
    return run_world(session, "quiz_demos.test_dtensor:dtensor_main", 4, timeout_s=180)


def test_the_inner_dimension_of_a_2d_mesh_groups_neighbouring_ranks(dtensor):
    for rank, seen in enumerate(dtensor):
        assert seen["tp_group"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert seen["dp_group"] == [rank % 2, rank % 2 + 2]


def test_colwise_shards_the_weight_by_rows_and_rowwise_by_columns(dtensor):
    for seen in dtensor:
        assert seen["colwise"] == {"weight": ["Shard(dim=0)"], "local": [3, 8], "bias": ["Shard(dim=0)"]}
        assert seen["rowwise"] == {"weight": ["Shard(dim=1)"], "local": [6, 4], "bias": ["Replicate()"]}


def test_a_colwise_module_returns_a_plain_local_tensor_unless_told_otherwise(dtensor):
    for seen in dtensor:
        assert seen["colwise_output"]["type"] == "Tensor" and seen["colwise_output"]["shape"] == [3, 3]
        assert seen["colwise_output"]["kept"] == ("DTensor", ["Shard(dim=1)"], [3, 6])  # the last dim


def test_rowwise_output_replicated_costs_an_all_reduce_and_sharded_over_the_sequence_a_reduce_scatter(dtensor):
    for seen in dtensor:
        assert seen["rowwise_to_replicate"] == {"collectives": ["all_reduce"], "shape": [2, 4, 6]}
        assert seen["rowwise_to_sequence"] == {"collectives": ["reduce_scatter_tensor"], "shape": [2, 2, 6]}


def test_to_local_communicates_nothing_and_full_tensor_gathers(dtensor):
    for seen in dtensor:
        assert seen["to_local_vs_full"]["to_local"] == []
        assert seen["to_local_vs_full"]["full_tensor"] == ["all_gather_into_tensor"]


def test_uneven_shards_follow_torch_chunk(dtensor):
    assert [seen["uneven_rows"] for seen in dtensor] == [[3, 2], [2, 2], [3, 2], [2, 2]]


def test_sequence_parallel_replicates_the_norm_weight_and_normalises_a_slice(dtensor):
    for seen in dtensor:
        assert seen["sequence_parallel"] == {"weight": ["Replicate()"], "out": ("DTensor", ["Shard(dim=1)"], [2, 3, 8])}


def test_fully_shard_after_the_plan_puts_each_parameter_on_the_2d_mesh(dtensor):
    for seen in dtensor:
        assert seen["two_d"]["dtensor"] and seen["two_d"]["mesh"] == ["dp", "tp"]
        assert seen["two_d"]["placements"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
        assert seen["two_d"]["local"] == [2, 8]
