"""Exercise 28's verdicts, from hand-made records (no processes started), and the grader's copies of the
script's training settings and data order.

Each verdict is shown passing on the record a right answer leaves and failing on a wrong one.
"""

from __future__ import annotations

import importlib.util
import math

from conftest import ROOT
from torch.utils.data import DataLoader, DistributedSampler

from grader.checks import ex28_fsdp_memory as ex
from grader.checks.shared import fsdp_job
from grader.rank.drivers.shared.stub_models import JOB_LAYERS

PARAMS = list(ex.build_model().named_parameters())


def _script(path: str):
    spec = importlib.util.spec_from_file_location("script28", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def held(world_size: int, *, plain=(), momentum=True) -> list[dict]:
    """One step's record of what a rank holds: each parameter's largest dim-0 shard, ``plain`` ones whole."""
    out = []
    for name, p in PARAMS:
        rows = p.shape[0] if name in plain else math.ceil(p.shape[0] / world_size)
        nbytes = rows * (p.numel() // p.shape[0]) * 4
        out.append({"name": name, "shape": list(p.shape), "dtensor": name not in plain, "bytes": nbytes,
                    "state_bytes": nbytes if momentum else 0})
    return out


def trace(forward_gathers: int, steps: int = 3, backward_gathers: int = 2) -> list[dict]:
    out = []
    for _ in range(steps):
        out += [{"op": "all_gather_into_tensor"}] * forward_gathers + [{"what": "backward"}]
        out += [{"op": "all_gather_into_tensor"}] * backward_gathers + [{"what": "step"}]
    return out


SCRIPTS = [f"{folder}/debug/{name}" for folder in ("exercises", "solutions")
           for name in ("28_fsdp_memory.py", "29_reshard_resume.py")]


def test_the_graders_training_settings_are_the_scripts():
    """Of every script of the FSDP2 family (28 and 29), as shipped and fixed (the model: tests/test_stub_models.py)."""
    for path in SCRIPTS:
        script = _script(path)
        assert (script.BATCH_SIZE, script.LR, script.MOMENTUM) == (fsdp_job.BATCH_SIZE, fsdp_job.LR, fsdp_job.MOMENTUM)


def test_the_replays_batches_are_what_the_scripts_loader_hands_each_rank():
    for world_size in (2, 3):
        per_rank = fsdp_job.sampler_batches(world_size, range(ex.EPOCHS))
        for rank in range(world_size):
            sampler = DistributedSampler(range(fsdp_job.N_TRAIN), num_replicas=world_size, rank=rank, shuffle=True)
            loader = DataLoader(range(fsdp_job.N_TRAIN), batch_size=fsdp_job.BATCH_SIZE, sampler=sampler)
            seen = []
            for epoch in range(ex.EPOCHS):
                sampler.set_epoch(epoch)
                seen += [[batch.tolist()] for batch in loader]
            assert per_rank[rank] == seen
        # every sample once per epoch, the ranks' batches disjoint
        first_epoch = [i for r in per_rank for step in r[:len(r) // ex.EPOCHS] for i in step[0]]
        assert sorted(first_epoch) == list(range(fsdp_job.N_TRAIN))


def test_a_rank_holding_its_shards_passes_the_memory_check():
    for world_size in (2, 3):
        records = [{"held": [held(world_size)] * 4} for _ in range(world_size)]
        assert ex.memory_verdict(records, world_size) == (True, "")


def test_the_root_left_whole_fails_the_memory_check_naming_the_plain_parameters():
    root = ("tok_embeddings.weight", "norm.weight", "norm.bias", "output.weight", "output.bias")
    records = [{"held": [held(2)]}, {"held": [held(2), held(2, plain=root)]}]
    ok, message = ex.memory_verdict(records, 2)
    assert not ok and message.startswith("rank 1, optimizer step 1:")
    assert "5 of the 17 parameters" in message and "tok_embeddings.weight [256, 32]" in message


def test_whole_momentum_buffers_alone_fail_the_memory_check():
    entries = held(2)
    entries[0] = dict(entries[0], state_bytes=entries[0]["state_bytes"] * 2)
    ok, message = ex.memory_verdict([{"held": [entries]}, {"held": [held(2)]}], 2)
    assert not ok and "of optimizer state" in message


def test_a_forward_gathering_each_block_and_the_root_passes_the_units_check():
    records = [{"trace": trace(JOB_LAYERS + 1)}, {"trace": trace(JOB_LAYERS + 1, backward_gathers=0)}]
    assert ex.units_verdict(records, 2) == (True, "")


def test_one_unit_or_none_fails_the_units_check():
    ok, message = ex.units_verdict([{"trace": trace(JOB_LAYERS + 1)}, {"trace": trace(1, backward_gathers=0)}], 2)
    assert not ok and message.startswith("rank 1, optimizer step 0:") and "1 unit(s)" in message
    ok, message = ex.units_verdict([{"trace": trace(0, backward_gathers=0)}], 1)
    assert not ok and "no parameter all-gather" in message


def test_gathers_in_the_backward_do_not_count_as_units():
    """The blocks alone, gathered again in the backward: 2 + 2 all-gathers a step, 2 units."""
    ok, message = ex.units_verdict([{"trace": trace(JOB_LAYERS, backward_gathers=JOB_LAYERS)}], 1)
    assert not ok and f"{JOB_LAYERS} unit(s)" in message
