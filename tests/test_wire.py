"""Reports from ranks: what they may carry arrives intact, and nothing else is rebuilt in the grader."""

from __future__ import annotations

import collections
import os
import pickle

import pytest
import torch

from grader.rank import wire


def _round_trip(value):
    return wire.loads(wire.dumps(value))


def test_plain_data_arrives_as_sent():
    report = {"status": "ok", "result": {"calls": [1, 2.5, "three", None, True, b"\x00"], "pair": (1, 2),
                                         "seen": {3, 4}, "frozen": frozenset({5}), "z": complex(1, -1),
                                         "ordered": collections.OrderedDict(b=1, a=2),
                                         "counts": collections.Counter("aab"), "raw": bytearray(b"xy")}}
    assert _round_trip(report) == report
    assert list(_round_trip(report)["result"]["ordered"]) == ["b", "a"]


def test_torch_values_of_a_report_arrive_as_sent():
    values = [torch.float16, torch.bfloat16, torch.int64, torch.Size([2, 3]), torch.device("cpu"), torch.strided]
    assert _round_trip(values) == values


@pytest.mark.parametrize("tensor", [
    torch.randn(3, 4), torch.arange(7), torch.zeros(0, 3), torch.tensor(2.5), torch.randn(3, 2).t(),
    torch.arange(10)[3:6], torch.ones(4, dtype=torch.bfloat16), torch.tensor([True, False]),
    torch.randn(2, dtype=torch.complex64), torch.tensor([1, 2], dtype=torch.uint8),
], ids=["matrix", "int64", "empty", "scalar", "transposed", "slice", "bfloat16", "bool", "complex", "uint8"])
def test_a_tensor_arrives_with_its_dtype_shape_and_values(tensor):
    got = _round_trip({"t": tensor})["t"]
    assert type(got) is torch.Tensor
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor)


def test_a_parameter_arrives_as_a_parameter_and_a_tensor_keeps_requires_grad():
    got = _round_trip({"p": torch.nn.Parameter(torch.randn(3)), "g": torch.randn(2, requires_grad=True)})
    assert isinstance(got["p"], torch.nn.Parameter) and got["p"].requires_grad
    assert got["g"].requires_grad and got["g"].is_leaf


def test_tensors_that_share_memory_in_the_rank_are_independent_copies_in_the_grader():
    base = torch.arange(6)
    got = _round_trip([base, base[:3]])
    got[0][0] = 100
    assert got[1][0] == 0


class Poison:
    def __reduce__(self):
        return os.system, ("echo THE GRADER RAN THIS",)


class LearnersOwn:
    pass


@pytest.mark.parametrize("payload, named", [
    (pickle.dumps({"result": Poison()}), "posix.system"),
    (pickle.dumps({"result": print}), "builtins.print"),
    (wire.dumps({"result": LearnersOwn()}), "LearnersOwn"),
    (pickle.dumps(torch.contiguous_format), "contiguous_format"),
], ids=["os.system", "a builtin function", "a class of the submission", "an object torch pickles by name"])
def test_a_report_naming_anything_outside_the_allowlist_is_refused_before_it_runs(payload, named, capfd):
    with pytest.raises(pickle.UnpicklingError, match=named):
        wire.loads(payload)
    assert "THE GRADER RAN THIS" not in capfd.readouterr().out


@pytest.mark.parametrize("fields, problem", [
    (("float32", (1000, 1000), b"\x00" * 4, False, False), "needs 4000000 bytes"),
    (("system", (1,), b"\x00" * 4, False, False), "not a dtype"),
    (("float32", (-1,), b"", False, False), "not a shape"),
    (("float32", [1], b"\x00" * 4, False, False), "not a shape"),
], ids=["size that does not match its bytes", "not a dtype", "negative shape", "shape not a tuple"])
def test_a_forged_tensor_is_refused_without_allocating_what_it_claims(fields, problem):
    class Forged:
        def __reduce__(self):
            return wire._tensor, fields

    with pytest.raises(pickle.UnpicklingError, match=problem):
        wire.loads(pickle.dumps(Forged()))


def test_a_tensor_the_report_cannot_carry_is_refused_in_the_rank():
    with pytest.raises(TypeError, match="plain tensor"):
        wire.dumps({"t": torch.eye(3).to_sparse()})
