"""Topic checkpoint: the ``module.`` prefix and its remedies, and loading on rank 0 only (two gloo
ranks write their observations; the loading tries run in this process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present


def net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def checkpoint_main(ctx) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: dict = {}
    with ctx.group():
        torch.manual_seed(ctx.rank)
        ddp = DDP(net())
        out["ddp_state"] = {k: v.clone() for k, v in ddp.state_dict().items()}
        out["module_state"] = {k: v.clone() for k, v in ddp.module.state_dict().items()}
        out["dcp_keys"] = sorted(get_model_state_dict(ddp))

        # Resume: rank 0 alone loads saved weights, then every rank wraps its model in DDP.
        saved = net()
        with torch.no_grad():
            for p in saved.parameters():
                p.fill_(0.5)
        torch.manual_seed(100 + ctx.rank)
        model = net()
        if ctx.rank == 0:
            model.load_state_dict(saved.state_dict())
        DDP(model)
        out["after_wrap"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.fixture(scope="module")
def ranks(session):
    from quiz_demos.world import run_world

    return run_world(session, "quiz_demos.test_checkpoint:checkpoint_main", 2)


@pytest.mark.slow
def test_ddp_state_dict_keys_start_with_module(ranks):
    keys = list(ranks[0]["ddp_state"])
    assert keys and all(k.startswith("module.") for k in keys)
    assert [k.removeprefix("module.") for k in keys] == list(ranks[0]["module_state"])
    assert "module.1.running_mean" in keys  # buffers are in it too


@pytest.mark.slow
def test_loading_the_ddp_state_into_a_plain_model_fails_on_the_keys(ranks):
    with pytest.raises(RuntimeError, match="(?s)Missing key\\(s\\).*Unexpected key\\(s\\)"):
        net().load_state_dict(ranks[0]["ddp_state"])


@pytest.mark.slow
def test_strict_false_loads_nothing_and_lists_every_key(ranks):
    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = model.load_state_dict(ranks[0]["ddp_state"], strict=False)
    assert len(result.unexpected_keys) == len(before)
    # Every key is missing (BatchNorm alone tolerates a missing num_batches_tracked).
    assert set(result.missing_keys) == {k for k in before if not k.endswith("num_batches_tracked")}
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_the_module_state_dict_loads_into_a_plain_model_and_under_ddp(ranks):
    plain = net()
    plain.load_state_dict(ranks[0]["module_state"])
    assert all(torch.equal(v, ranks[0]["module_state"][k]) for k, v in plain.state_dict().items())


@pytest.mark.slow
def test_consume_prefix_strips_module_in_place(ranks):
    state = dict(ranks[0]["ddp_state"])
    consume_prefix_in_state_dict_if_present(state, "module.")
    net().load_state_dict(state)  # strict
    assert list(state) == list(ranks[0]["module_state"])


@pytest.mark.slow
def test_dataparallel_also_expects_the_module_prefix(ranks):
    wrapped = nn.DataParallel(net())  # on a machine without GPUs it just holds the module
    wrapped.load_state_dict(ranks[0]["ddp_state"])  # strict: the keys match
    assert all(k.startswith("module.") for k in wrapped.state_dict())


@pytest.mark.slow
def test_get_model_state_dict_returns_keys_without_the_prefix(ranks):
    assert ranks[0]["dcp_keys"] == sorted(ranks[0]["module_state"])


@pytest.mark.slow
def test_loading_on_rank_0_only_is_enough_for_the_model(ranks):
    for p in ranks[1]["after_wrap"]:
        assert torch.equal(p, torch.full_like(p, 0.5))
