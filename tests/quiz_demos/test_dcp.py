"""Demonstrations for the quiz topic 'dcp' (grader/quiz/bank/dcp.toml).

Two gloo ranks shard a small model with FSDP2 and save it with torch.distributed.checkpoint;
this process then loads that checkpoint into a plain, unsharded model without any process group
(a different world size: resharding on load).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from quiz_demos.world import run_world

pytestmark = pytest.mark.slow


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def dcp_main(ctx) -> dict:
    with ctx.group():
        return dcp_observations(ctx.rank, ctx.world_size, ctx.kwargs["root"])


def dcp_observations(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    # DDP: get_model_state_dict gives the keys without the wrapper's prefix.
    ddp = nn.parallel.DistributedDataParallel(_model())
    out["ddp_keys"] = sorted(ddp.state_dict())
    out["ddp_dcp_keys"] = sorted(get_model_state_dict(ddp))
    # Replicated tensors (the same on every rank): 256 KiB of weights, to dwarf per-file overhead.
    torch.manual_seed(0)
    big = nn.parallel.DistributedDataParallel(nn.Linear(256, 256))
    dcp.save(get_model_state_dict(big), checkpoint_id=os.path.join(root, "ddp"))

    # FSDP2: each rank holds a dim-0 shard; DCP writes each rank's shards.
    mesh = init_device_mesh("cpu", (world_size,))
    model = _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = get_model_state_dict(model)
    out["sharded"] = {k: (type(v).__name__, tuple(v.to_local().shape), tuple(v.shape)) for k, v in sharded.items()}
    dcp.save(sharded, checkpoint_id=os.path.join(root, "fsdp"))

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["full_keys"] = sorted(full)
    out["full"] = {k: v.clone() for k, v in full.items()} if rank == 0 else {}
    return out


@pytest.fixture(scope="module")
def saved(session, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    return root, run_world(session, "quiz_demos.test_dcp:dcp_main", 2, timeout_s=180, kwargs={"root": root})


def test_get_model_state_dict_drops_the_ddp_prefix(saved):
    _, ranks = saved
    assert all(k.startswith("module.") for k in ranks[0]["ddp_keys"])
    assert ranks[0]["ddp_dcp_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_sharded_state_dict_holds_dtensor_shards(saved):
    _, ranks = saved
    for rank, seen in enumerate(ranks):
        assert seen["sharded"]["0.weight"] == ("DTensor", (3, 4), (6, 4)), f"rank {rank}"
    # 3 rows over 2 ranks: torch.chunk-style, 2 then 1.
    assert [r["sharded"]["2.weight"][1] for r in ranks] == [(2, 6), (1, 6)]


def test_save_writes_one_file_per_rank_and_a_metadata_file(saved):
    root, _ = saved
    assert sorted(os.listdir(os.path.join(root, "fsdp"))) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_replicated_ddp_tensors_are_written_once(saved):
    root, _ = saved
    folder = os.path.join(root, "ddp")
    sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)}
    payload = (256 * 256 + 256) * 4
    data = sizes["__0_0.distcp"] + sizes["__1_0.distcp"]
    assert payload <= data < 2 * payload    # not one full copy per rank


def test_full_state_dict_with_cpu_offload_lands_on_rank_0_only(saved):
    _, ranks = saved
    assert ranks[0]["full_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert ranks[1]["full_keys"] == []
    assert tuple(ranks[0]["full"]["0.weight"].shape) == (6, 4)


def test_load_reshards_into_one_plain_process_without_a_process_group(saved):
    import torch.distributed.checkpoint as dcp

    root, ranks = saved
    assert not dist.is_initialized()
    plain = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))   # fresh weights
    state = plain.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.load(state, checkpoint_id=os.path.join(root, "fsdp"))      # fills the tensors in place
    assert any("single process" in str(w.message) for w in caught)
    plain.load_state_dict(state)
    for key, tensor in ranks[0]["full"].items():
        assert torch.equal(plain.state_dict()[key], tensor), key


class Counter:
    """An application object DCP treats as Stateful (it has state_dict and load_state_dict)."""

    def __init__(self, step):
        self.step = step
        self.loaded = False

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        self.loaded = True


def test_stateful_objects_are_saved_and_restored_through_their_methods(tmp_path):
    import torch.distributed.checkpoint as dcp

    if dist.is_initialized():
        pytest.skip("shows the single-process behaviour")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"app": Counter(7)}, checkpoint_id=str(tmp_path))
        restored = Counter(0)
        dcp.load({"app": restored}, checkpoint_id=str(tmp_path))
    assert restored.loaded and restored.step == 7
