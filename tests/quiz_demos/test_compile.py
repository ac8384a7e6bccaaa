"""Demonstrations for the quiz topic 'compile' (grader/quiz/bank/compile.toml).

A gloo world of one process (in this process) is enough: DDPOptimizer splits the graph from the
parameter sizes and DDP's bucket cap, whatever the world size. A counting backend records the
graphs Dynamo hands to the compiler.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.slow


class FourLayers(nn.Module):
    """Four 512x512 linear layers: about 1 MiB of float32 parameters each."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.fixture(scope="module")
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def compiled_graphs(optimize_ddp, bucket_cap_mb, wrap_first=True):
    """Node counts of the graphs a compiled DDP model's first forward hands to the backend."""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        reason = getattr(gm, "compile_subgraph_reason", None)
        graphs.append({"nodes": len(gm.graph.nodes), "reason": getattr(reason, "reason", "")})
        return gm.forward

    old = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = optimize_ddp
    try:
        torch.manual_seed(0)
        if wrap_first:
            model = torch.compile(nn.parallel.DistributedDataParallel(FourLayers(), bucket_cap_mb=bucket_cap_mb),
                                  backend=counting_backend)
        else:
            model = nn.parallel.DistributedDataParallel(torch.compile(FourLayers(), backend=counting_backend),
                                                        bucket_cap_mb=bucket_cap_mb)
        model(torch.randn(2, 512)).sum().backward()
    finally:
        torch._dynamo.config.optimize_ddp = old
        torch._dynamo.reset()
    return graphs


def test_optimize_ddp_is_on_by_default():
    assert torch._dynamo.config.optimize_ddp is True
    assert torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer"


def test_ddp_optimizer_breaks_the_graph_at_bucket_boundaries(world_of_one):
    split = compiled_graphs(True, bucket_cap_mb=1)
    whole = compiled_graphs(False, bucket_cap_mb=1)
    assert len(split) == 4      # one subgraph per 1 MiB bucket
    assert len(whole) == 1      # no split: one graph, so every gradient is ready at once
    assert all("DDPOptimizer intentional graph-break" in g["reason"] for g in split)


def test_split_count_follows_bucket_cap_and_the_small_first_bucket(world_of_one):
    # Counting parameter sizes from the end of the graph: the first bucket closes at
    # 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), later ones at bucket_cap_mb.
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    assert len(compiled_graphs(True, bucket_cap_mb=25)) == 2
    assert len(compiled_graphs(True, bucket_cap_mb=100)) == 2      # a cap above the model size too


def test_compiling_the_inner_module_also_gets_split_on_this_torch(world_of_one):
    assert len(compiled_graphs(True, bucket_cap_mb=1, wrap_first=False)) == 4
