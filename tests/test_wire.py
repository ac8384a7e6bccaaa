"""What ranks send is data: every kind of value a driver may return arrives as it was sent, with its type;
nothing else is written; and nothing the grader reads can run code, recurse without bound, or make it
allocate more than a small multiple of the bytes it read."""

from __future__ import annotations

import collections
import json
import math
import pickle
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grader.rank import wire
from conftest import ROOT


def _round_trip(value):
    return wire.loads(wire.dumps(value))


def _message(header, data: bytes = b"") -> bytes:
    """A message as a rank could write it by hand."""
    text = (header if isinstance(header, bytes) else json.dumps(header).encode())
    return wire.MAGIC + len(text).to_bytes(8, "little") + text + data


def _same(a, b) -> bool:
    """Equal, and of the same types all the way down (1 == 1.0 == True, (1,) != [1] only by type)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1
                                                                         and a.dtype.is_floating_point else a,
                                                                         b.view(torch.uint8) if b.dtype.itemsize == 1
                                                                         and b.dtype.is_floating_point else b)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(k, kb) and _same(a[k], b[kb]) for k, kb in zip(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# --- what a driver may return arrives as sent ---------------------------------------------------------


def test_plain_data_arrives_with_its_types():
    report = {"status": "ok", "result": {
        "calls": [1, 2.5, "three", None, True, b"\x00\xff", -0.0], "pair": (1, (2, [3])), "empty": (),
        "by_rank": {0: "a", 1: "b"}, "by_pair": {(0, 1): 2.0, (1, 0): -1}, "seen": {3, 4}, "frozen": frozenset({5}),
        "sets_of": {frozenset({1, 2}): {"x"}}, "z": complex(1, -1), "raw": bytearray(b"xy"),
        "nan": math.nan, "inf": [math.inf, -math.inf], "big": 2**200, "text": 'a "quote" \\ [{]} \x00 \u202e é \ud800',
        "\x00": "a dict that uses the wire's own key", "nested": [[[[{"deep": (1,)}]]]],
    }}
    got = _round_trip(report)
    assert _same(got, report), got


def test_torch_values_arrive_as_sent():
    values = [torch.float16, torch.bfloat16, torch.int64, torch.float8_e4m3fn, torch.float8_e5m2, torch.Size([2, 3]),
              torch.device("cpu"), torch.strided, torch.Size([])]
    got = _round_trip(values)
    assert got == values and [type(v) for v in got] == [type(v) for v in values]


def test_dict_subclasses_named_tuples_and_numbers_of_other_types_arrive_as_plain_data():
    point = collections.namedtuple("Point", "x y")(1, 2)
    got = _round_trip({"ordered": collections.OrderedDict(b=1, a=2), "counts": collections.Counter("aab"),
                       "point": point, "max": torch.randn(3).max(0)})
    assert type(got["ordered"]) is dict and list(got["ordered"]) == ["b", "a"]
    assert got["counts"] == {"a": 2, "b": 1} and got["point"] == (1, 2) and type(got["point"]) is tuple
    assert type(got["max"]) is tuple and len(got["max"]) == 2


TENSORS = [torch.randn(3, 4), torch.arange(7), torch.zeros(0, 3), torch.tensor(2.5), torch.randn(3, 2).t(),
           torch.arange(10)[3:6], torch.ones(4, dtype=torch.bfloat16), torch.tensor([True, False]),
           torch.randn(2, dtype=torch.complex64), torch.tensor([1, 2], dtype=torch.uint8),
           torch.randn(4, 2).to(torch.float8_e4m3fn), torch.randn(3).to(torch.float8_e5m2),
           torch.randn(2, 2, dtype=torch.float64), torch.tensor([-3, 4], dtype=torch.int8),
           torch.tensor([1, 2], dtype=torch.int32), torch.randn(5).half()]


@pytest.mark.parametrize("tensor", TENSORS, ids=lambda t: f"{str(t.dtype)[6:]}{list(t.shape)}")
def test_a_tensor_arrives_with_its_dtype_shape_and_values(tensor):
    got = _round_trip({"t": tensor})["t"]
    assert type(got) is torch.Tensor and _same(got, tensor.contiguous())


def test_a_parameter_arrives_as_a_parameter_and_a_tensor_keeps_requires_grad():
    got = _round_trip({"p": torch.nn.Parameter(torch.randn(3)), "g": torch.randn(2, requires_grad=True),
                       "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False)})
    assert isinstance(got["p"], torch.nn.Parameter) and got["p"].requires_grad
    assert got["g"].requires_grad and got["g"].is_leaf
    assert isinstance(got["frozen"], torch.nn.Parameter) and not got["frozen"].requires_grad


def test_tensors_that_share_memory_in_the_rank_are_independent_copies_in_the_grader():
    base = torch.arange(6)
    got = _round_trip([base, base[:3]])
    got[0][0] = 100
    assert got[1][0] == 0


def test_the_header_is_json_and_the_tensors_raw_bytes_after_it():
    message = wire.dumps({"t": torch.tensor([1.0, 2.0]), "k": (1,)})
    size = int.from_bytes(message[4:12], "little")
    header = json.loads(message[12:12 + size])
    assert message[:4] == wire.MAGIC and message[12 + size:] == torch.tensor([1.0, 2.0]).numpy().tobytes()
    assert header == {"t": {"\x00": "tensor", "dtype": "float32", "shape": [2], "n": 8},
                      "k": {"\x00": "tuple", "items": [1]}}


class LearnersOwn:
    pass


@pytest.mark.parametrize("value, named", [
    (LearnersOwn(), "LearnersOwn"), (print, "builtin_function_or_method"), (object, "type"),
    (torch.eye(3).to_sparse(), "plain tensor"), (torch.nn.Linear(2, 2), "Linear"),
])
def test_a_value_that_is_not_plain_data_is_refused_in_the_rank(value, named):
    with pytest.raises(TypeError, match=named):
        wire.dumps({"result": [value]})


def test_a_value_nested_deeper_than_the_limit_is_refused_in_the_rank():
    deepest: list = []  # MAX_DEPTH lists, one in the other
    for _ in range(wire.MAX_DEPTH - 1):
        deepest = [deepest]
    assert _round_trip(deepest) == deepest
    with pytest.raises(ValueError, match="nested"):
        wire.dumps([deepest])


def test_the_deepest_value_the_rank_may_write_is_read():
    """A dict with other keys than text takes three levels of JSON (the object, its pairs, a pair)."""
    chain: object = {0: 1}  # MAX_DEPTH dicts, one in the other
    for level in range(1, wire.MAX_DEPTH):
        chain = {level: chain}
    key: object = (1,)  # a key of MAX_DEPTH - 1 tuples, one in the other
    for _ in range(wire.MAX_DEPTH - 2):
        key = (key,)
    for value in (chain, {key: [1]}):
        assert _round_trip(value) == value


# --- nothing but data is read -------------------------------------------------------------------------


class Poison:
    def __reduce__(self):
        return print, ("THE GRADER RAN THIS",)


@pytest.mark.parametrize("payload", [
    pickle.dumps({"result": Poison()}), pickle.dumps({"status": "ok"}), b"", b"DDPW", b"{}",
], ids=["a pickle that calls print", "a plain pickle", "nothing", "a magic without a length", "bare json"])
def test_anything_but_a_message_of_the_wire_is_refused_before_it_runs(payload, capfd):
    with pytest.raises(wire.Unreadable, match="not a message"):
        wire.loads(payload)
    assert "THE GRADER RAN THIS" not in capfd.readouterr().out


@pytest.mark.parametrize("header, data, problem", [
    ({"\x00": "tensor", "dtype": "int64", "shape": [50_000_000], "n": 8}, b"\0" * 8, "does not match its shape"),
    ({"\x00": "tensor", "dtype": "float32", "shape": [1000, 1000], "n": 4_000_000}, b"\0" * 4, "where 4 are left"),
    ({"\x00": "tensor", "dtype": "float32", "shape": [2], "n": 8}, b"\0" * 9, "no value of the header claims"),
    ({"\x00": "tensor", "dtype": "system", "shape": [1], "n": 4}, b"\0" * 4, "unknown dtype"),
    ({"\x00": "tensor", "dtype": "qint8", "shape": [1], "n": 1}, b"\0", "unknown dtype"),
    ({"\x00": "tensor", "dtype": "float32", "shape": [-1], "n": 0}, b"", "shape"),
    ({"\x00": "tensor", "dtype": "float32", "shape": "[1]", "n": 4}, b"\0" * 4, "shape"),
    ({"\x00": "tensor", "dtype": "float32", "shape": [1] * 40, "n": 4}, b"\0" * 4, "shape"),
    ({"\x00": "tensor", "dtype": "float32", "shape": [1], "n": 4, "code": "x"}, b"\0" * 4, "fields"),
    ({"\x00": "tensor", "dtype": "float32", "shape": [1], "n": 4, "grad": "yes"}, b"\0" * 4, "flags"),
    ({"\x00": "bytes", "n": 3_380_000_000}, b"x" * 150, "claims 3,380,000,000 bytes where 150 are left"),
    ({"\x00": "bytearray", "n": -1}, b"", "claims"),
    ({"\x00": "pickle", "items": []}, b"", "unknown kind"),
    ({"\x00": "dict", "items": [[1]]}, b"", "pairs"),
    ({"\x00": "dict", "items": [[[1], 2]]}, b"", "cannot be one"),
    ({"\x00": "set", "items": [{"a": 1}]}, b"", "cannot be one"),
    ({"\x00": "dtype", "name": "Tensor"}, b"", "unknown dtype"),
    ({"\x00": "device", "name": "x" * 100}, b"", "device"),
    ({"\x00": "size", "items": [1.5]}, b"", "integers"),
    ({"\x00": "tuple", "items": 3}, b"", "not a list"),
    (b'{"a": [1, 2}', b"", "JSONDecodeError"),
    (b'[1, 2]\xff', b"", "Error"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_forged_message_is_refused_without_allocating_what_it_claims(header, data, problem):
    with pytest.raises(wire.Unreadable, match=problem):
        wire.loads(_message(header, data))


def test_a_bool_tensor_holds_only_true_and_false_whatever_its_bytes():
    got = wire.loads(_message({"\x00": "tensor", "dtype": "bool", "shape": [3], "n": 3}, bytes([0, 1, 7])))
    assert got.view(torch.uint8).tolist() == [0, 1, 1]


def test_nesting_is_measured_before_the_parser_runs():
    for depth in (wire.MAX_JSON_DEPTH + 1, 10**7):
        with pytest.raises(wire.Unreadable, match=f"nested {depth:,} deep"):
            wire.loads(_message(b"[" * depth + b"]" * depth))
    assert wire.loads(_message(b"[" * wire.MAX_JSON_DEPTH + b"]" * wire.MAX_JSON_DEPTH)) == \
        json.loads("[" * wire.MAX_JSON_DEPTH + "]" * wire.MAX_JSON_DEPTH)


def test_a_dict_key_nested_ten_million_deep_is_refused_before_any_hash():
    """The tuple that made hash() recurse in C until the grader died (SIGSEGV), as a frame could carry it."""
    for depth, why in ((100_000, "nested 200,003 deep"), (10**7 // 30, "values")):  # the second: 10 MB
        key = b'{"\\u0000":"tuple","items":[' * depth + b"1" + b"]}" * depth
        header = b'{"\\u0000":"dict","items":[[' + key + b',1]]}'
        with pytest.raises(wire.Unreadable, match=why):
            wire.loads(_message(header))


def test_brackets_and_quotes_inside_strings_do_not_count_as_nesting():
    tricky = ['"]]]]', "[[[[", "\\", '\\"[', "\\\\", '\\\\"', "{" * 500]
    assert _round_trip(tricky) == tricky
    assert wire.structure(json.dumps(["]" * 50 + "[" * 300]).encode()) == (1, 2)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) |
                     st.text(alphabet=st.sampled_from('ab"\\[]{},:\x00é')),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                         st.text(alphabet=st.sampled_from('k"\\[]{}:,'), max_size=4), inner, max_size=4),
                     max_leaves=30)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def _count(value) -> int:
    if isinstance(value, list):
        return 1 + sum(map(_count, value))
    if isinstance(value, dict):
        return 1 + len(value) + sum(map(_count, value.values()))
    return 1


@settings(max_examples=300, deadline=None)
@given(_json, st.booleans(), st.integers(0, 2))
def test_nesting_and_values_are_never_undercounted_and_deep_nesting_is_exact(value, spaced, around):
    """Strings full of brackets, quotes and backslashes included: what the parser would see is counted."""
    wrapped = value
    for _ in range(around * wire.MAX_JSON_DEPTH):  # past the limit, measured exactly
        wrapped = ["]", {"[": wrapped}]
    text = json.dumps(wrapped, separators=(", ", ": ") if spaced else (",", ":")).encode()
    depth, values = wire.structure(text)
    assert depth >= _depth(wrapped) and values >= _count(wrapped)
    if around:
        assert depth == _depth(wrapped)


def test_values_past_the_budget_are_refused_before_they_are_built():
    header = b"[" + b"{}," * 2_000_000 + b"{}]"
    with pytest.raises(wire.OverBudget, match="values"):
        wire.loads(_message(header))


def test_the_ranks_of_one_run_share_one_budget():
    message = wire.dumps({"t": torch.zeros(3_000_000, dtype=torch.uint8)})
    budget = wire.Budget()
    wire.loads(message, budget)
    wire.loads(message, budget)
    with pytest.raises(wire.OverBudget, match="tensor elements"):
        wire.loads(message, budget)
    assert wire.loads(message)["t"].numel() == 3_000_000  # a fresh budget reads it again


def test_keys_made_to_collide_are_refused_before_the_dict_is_built():
    prime = 2**61 - 1  # every multiple of it hashes to 0
    colliding = [k * prime for k in range(1, 20_001)]
    for header in ({"\x00": "set", "items": colliding},
                   {"\x00": "dict", "items": [[k, 0] for k in colliding]}):
        with pytest.raises(wire.Unreadable, match="share 1 hashes"):
            wire.loads(_message(header))
    assert len(_round_trip(set(range(20_000)))) == 20_000


def test_parse_json_bounds_text_that_is_plain_json():
    assert wire.parse_json(b'{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}
    with pytest.raises(wire.Unreadable, match="nested"):
        wire.parse_json("[" * 5000 + "]" * 5000)


# --- the grader's own memory -------------------------------------------------------------------------

ATTACKS = {
    "lying storage": _message({"\x00": "tensor", "dtype": "int64", "shape": [50_000_000], "n": 8}, b"\0" * 8),
    "bytes that claim gigabytes": _message({"\x00": "bytearray", "n": 3_380_000_000}, b"\0" * 150),
    "deep key": _message(b'{"\\u0000":"dict","items":[[' + b'{"\\u0000":"tuple","items":[' * 300_000 + b"1" +
                         b"]}" * 300_000 + b',1]]}'),
    "values": _message(b"[" + b"[]," * 20_000_000 + b"[]]"),
}


def test_reading_each_attack_keeps_the_grader_small():
    """Each attack, read in a fresh interpreter: refused, and that process's peak resident memory stays
    within what reading the message itself takes."""
    script = (
        "import resource, sys, torch\n"
        "from grader.rank import wire\n"
        "data = sys.stdin.buffer.read()\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    wire.loads(data)\n"
        "    print('read')\n"
        "except wire.Unreadable as exc:\n"
        "    print('refused:', exc)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    for name, message in ATTACKS.items():
        done = subprocess.run([sys.executable, "-c", script], input=message, capture_output=True, cwd=ROOT,
                              timeout=300)
        said, grown = done.stdout.decode().splitlines()[-2:]
        assert said.startswith("refused"), (name, done.stdout, done.stderr[-2000:])
        assert int(grown) * 1024 < 4 * len(message) + 64 * 2**20, (name, int(grown) // 1024, "MiB more")
