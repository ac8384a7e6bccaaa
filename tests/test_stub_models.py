"""Every model the grader builds from a stub's or a script's code is that code's model: the same parameters,
the same initial values from the same seed, the same output and loss (grader/rank/drivers/shared/stub_models.py;
41-43's transformer in grader/rank/drivers/shared/capacity_model.py)."""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

from conftest import ROOT
from grader import capacity
from grader.rank.drivers import ex15_elastic as elastic
from grader.checks.shared import capacity_cases as cases
from grader.rank.drivers.shared import capacity_model as cm
from grader.rank.drivers.shared import stub_models as sm


STUBS = ROOT / "grader" / "stubs"


@dataclass
class Copy:
    """One copy: ``theirs(stub)`` builds the file's model, ``ours()`` the grader's, each right after the same seed;
    ``inputs()`` what both are called with; ``loss`` the file's loss function's name and the grader's own, if any."""

    path: str
    theirs: Callable
    ours: Callable
    inputs: Callable
    loss: tuple[str, Callable] | None = None


def _tokens(vocab: int, shape=(2, 8)):
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, shape, generator=generator), torch.randint(0, vocab, shape, generator=generator)


def _features():
    return (torch.randn(5, 16, generator=torch.Generator().manual_seed(7)),)


COPIES = {
    "15's build_model": Copy("15_elastic.py", lambda s: s.build_model(), lambda: elastic.build_model(),
                             lambda: (torch.randn(5, 8, generator=torch.Generator().manual_seed(7)),)),
    **{f"{n}'s Net": Copy(f"debug/{n}.py", lambda s: s.Net(), sm.TwoLayerNet, _features)
       for n in ("21_eval_hang", "23_uneven_batches", "24_rank_drift", "25_data_order", "26_accum_sync", "27_resume")},
    "22's Net": Copy("debug/22_unused_params.py", lambda s: s.Net(), sm.TwoHeadNet, _features),
    **{f"{n}'s Net": Copy(f"debug/{n}.py", lambda s: s.Net(), sm.JobNet, lambda: _tokens(sm.JOB_VOCAB)[:1])
       for n in ("28_fsdp_memory", "29_reshard_resume")},
    "31's Transformer": Copy("31_fsdp2.py", lambda s: s.Transformer(), lambda: sm.Transformer(block=sm.FusedBlock),
                             lambda: _tokens(sm.VOCAB), ("loss_fn", sm.lm_loss)),
    "32's Transformer": Copy("32_dtensor_tp.py", lambda s: s.Transformer(), lambda: sm.Transformer(block=sm.Block),
                             lambda: _tokens(sm.VOCAB), ("loss_fn", sm.lm_loss)),
    "33's Model": Copy("33_dcp.py", lambda s: s.Model(), sm.MLPModel,
                       lambda: (torch.randn(4, sm.MLP_IN, generator=torch.Generator().manual_seed(7)),)),
    "36's Model": Copy("36_hybrid_recovery.py", lambda s: s.Model(), sm.MLPModel,
                       lambda: (torch.randn(4, sm.MLP_IN, generator=torch.Generator().manual_seed(7)),)),
    "34's Model": Copy("34_pipelining.py", lambda s: s.Model(n_layers=4).double(),
                       lambda: sm.PipelineModel(n_layers=4).double(), lambda: _tokens(sm.PIPE_VOCAB),
                       ("loss_fn", sm.pipeline_loss)),
}


def load_stub(relative: str):
    path = STUBS / relative
    spec = importlib.util.spec_from_file_location(f"stub_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(COPIES))
def test_the_graders_copy_is_the_files_model(name):
    copy = COPIES[name]
    stub = load_stub(copy.path)
    torch.manual_seed(11)
    theirs = copy.theirs(stub)
    torch.manual_seed(11)
    ours = copy.ours()
    assert [(k, t.shape) for k, t in theirs.state_dict().items()] == [(k, t.shape) for k, t in ours.state_dict().items()]
    for (key, a), b in zip(theirs.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), key
    inputs = copy.inputs()
    if copy.loss is None:
        for a, b in zip(*(m(*inputs) if isinstance(m(*inputs), tuple) else (m(*inputs),) for m in (theirs, ours))):
            assert torch.equal(a, b)
        return
    tokens, targets = inputs
    their_loss, our_loss = getattr(stub, copy.loss[0]), copy.loss[1]
    assert torch.equal(their_loss(theirs(tokens), targets), our_loss(ours(tokens), targets))


def test_every_model_of_stub_models_is_held_to_a_file():
    """A model added to stub_models.py without a copy above fails here."""
    held = set()
    for copy in COPIES.values():
        torch.manual_seed(0)
        held |= {type(m) for m in copy.ours().modules()}
    defined = {c for _, c in inspect.getmembers(sm, inspect.isclass)
               if issubclass(c, nn.Module) and c.__module__ == sm.__name__}
    assert defined - held == set()


# --- 41-43: the cost model's transformer, written out for a rank ----------------------------------------------


def _stub_names(i: int | None, name: str) -> str:
    """41's Transformer's parameter for one of capacity_model's names."""
    whole = {"tok_emb": "tokens.weight", "pos_emb": "positions.weight", "lnf_w": "norm.weight", "lnf_b": "norm.bias",
             "head_w": "head.weight"}
    if i is None:
        return whole[name]
    short = {"ln1": "norm1", "ln2": "norm2", "qkv": "qkv", "out": "out", "fc1": "fc1", "fc2": "fc2"}
    part, kind = name.rsplit("_", 1)
    return f"layers.{i}.{short[part]}.{'weight' if kind == 'w' else 'bias'}"


def test_the_capacity_runs_train_41s_transformer():
    """The small configurations 41-43 measure train 41's stub's Transformer: the same parameters under another
    name each, and, from the same values, the same loss (dropout off) in one process."""
    stub = load_stub("41_memory.py")
    plan = capacity.Plan(precision="fp32")
    kwargs = cases.measure_kwargs(cases.SMALL, plan)
    spec, plan = cm.spec_of(kwargs["model"], kwargs["layout"]), cm.plan_of(kwargs["plan"], kwargs["layout"])
    params = cm.full_parameters(spec, seed=cases.SEED)
    theirs = stub.Transformer(stub.ModelSpec(layers=spec.layers, hidden=spec.hidden, heads=spec.heads, vocab=spec.vocab,
                                             seq_len=spec.seq_len)).eval()
    named = {}
    for key, value in params.items():
        i, short = (int(key.split(".")[1]), key.split(".")[2]) if key.startswith("layers.") else (None, key)
        named[_stub_names(i, short)] = value
    assert {k: tuple(t.shape) for k, t in theirs.state_dict().items()} == {k: tuple(t.shape) for k, t in named.items()}
    theirs.load_state_dict(named)

    layers = [cm.Layer({s: params[f"layers.{i}.{s}"] for s in cm.layer_shapes(spec, i)}, spec, plan, {}, i, 0.0)
              for i in range(spec.layers)]
    ends = cm.Ends(params, spec, plan, {}, (0, 0, 0, 0))
    tokens, targets = _tokens(spec.vocab, (2, spec.seq_len))
    x = ends.embed(tokens)
    for layer in layers:
        x = layer(x)
    ours = ends.loss(x, targets)
    logits = theirs(tokens)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, spec.vocab), targets.reshape(-1))
    assert ours.item() == pytest.approx(expected.item(), rel=1e-6)
