"""How what a rank sends travels to the grader: data, never objects.

A message is a JSON header, then the raw bytes of its tensors and ``bytes`` values, in the order
the header names them (the layout of safetensors: a header, then the data):

    b"DDPW"  header length (8 bytes, little-endian)  header (ASCII JSON)  data

What a driver may return (CONTRIBUTING.md, "A driver returns plain data only") and how each travels:
``None``, ``bool``, ``int``, ``float`` (NaN and the infinities included), ``str``, ``list`` and a
``dict`` whose keys are all strings are JSON's own; every other value is a JSON object tagged with
the key ``"\\u0000"`` (:data:`TAG`): a tuple, a set or a frozenset (``items``), a dict with other keys
(``items``: ``[key, value]`` pairs), ``bytes``/``bytearray`` (``n`` bytes of the data), a tensor
(``dtype``, ``shape``, ``n`` bytes of the data; ``grad`` and ``param`` when it requires grad or is
a parameter), a dtype, a ``torch.Size``, a device, a layout, a complex number. Anything else is
refused where it is written (TypeError in the rank).

The reader trusts none of it, and nothing it reads can allocate more than a fixed multiple of the
bytes it read, or make it recurse without bound: before the header reaches :func:`json.loads` (whose
parser recurses in C), its nesting is measured outside its strings and refused past
:data:`MAX_JSON_DEPTH`, and its values are counted; a tensor's bytes must be exactly what its dtype
and shape need (a claim of 5*10^7 elements on 8 bytes is refused before anything is allocated) and
every byte of the data belongs to one value; the keys of a dict or set built here may not collide
by design (hash flooding). What one run's ranks send together is charged to one :class:`Budget`
(bytes, values, tensor elements), so that a run's messages, and the checks' own work on them
(``.tolist()`` included), stay a few hundred MiB at most. Every refusal is :class:`Unreadable`, whose
message says what was wrong: the submission's failure, never the grader's.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import struct
import sys

MAGIC = b"DDPW"
TAG = "\x00"  # the key of a tagged value; a dict that has it travels as pairs
MAX_DEPTH = 64  # levels a value may nest (checked where it is written)
MAX_JSON_DEPTH = 3 * MAX_DEPTH + 8  # JSON levels (a dict as pairs takes 3 per level): checked before parsing
MAX_DIMS = 32

# What the ranks of one run (or one worker's reply, or the files one check reads) may send in all.
MAX_BYTES = 64 * 2**20
MAX_VALUES = 1_000_000  # JSON values: each costs the grader at most about 100 bytes
MAX_ELEMENTS = 8_000_000  # tensor elements: a check's .tolist() of all of them is about 256 MiB
HASH_SLACK = 16  # keys of one dict or set that may share a hash before they count as crafted

_DTYPE_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
                "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz")
_LAYOUT_NAMES = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn")


@functools.lru_cache(maxsize=None)
def _torch_names() -> tuple[dict, dict]:
    """({name: dtype or layout}, {dtype or layout: name}) for what travels by name. Imported when first
    needed: the wire itself needs no torch (the grader writes its requests to the sandbox before it
    imports torch)."""
    import torch

    by_name = {name: getattr(torch, name) for name in _DTYPE_NAMES + _LAYOUT_NAMES
               if isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))}
    return by_name, {value: name for name, value in by_name.items()}


_LEAVES = frozenset({str, int, float, bool, type(None)})
_STR = frozenset({str})
_HEAD = len(MAGIC) + 8


class Unreadable(ValueError):
    """What a rank sent cannot be read as data within the limits; the message says why."""


class OverBudget(Unreadable):
    """More than is left to read of a :class:`Budget`."""


class Budget:
    """What may still be read: bytes, JSON values and tensor elements. One budget is charged by every
    message of one run (or one reply, or the files one check reads), so that many ranks, each within the
    limits, cannot add up past them."""

    def __init__(self, bytes: int = MAX_BYTES, values: int = MAX_VALUES, elements: int = MAX_ELEMENTS):
        self.bytes, self.values, self.elements = bytes, values, elements
        self._total = {"bytes": bytes, "values": values, "tensor elements": elements}

    def charge(self, *, nbytes: int = 0, values: int = 0, elements: int = 0) -> None:
        for name, asked, left in (("bytes", nbytes, self.bytes), ("values", values, self.values),
                                  ("tensor elements", elements, self.elements)):
            if asked > left:
                raise OverBudget(f"{asked:,} {name} where {left:,} are left to read (at most {self._total[name]:,} "
                                 "for one run's ranks together)")
        self.bytes -= nbytes
        self.values -= values
        self.elements -= elements


# --- writing (in the rank) --------------------------------------------------------------------------


def dumps(payload) -> bytes:
    """``payload`` as one message for :func:`loads`; TypeError for a value it cannot carry, ValueError for
    one nested deeper than MAX_DEPTH."""
    blobs: list = []
    tree = _plain(payload, blobs, 0)
    # ensure_ascii (json's default) writes every other character escaped, lone surrogates too
    header = json.dumps(tree, separators=(",", ":"), check_circular=False).encode("ascii")
    return b"".join([MAGIC, len(header).to_bytes(8, "little"), header, *blobs])


def _plain(value, blobs: list, depth: int):
    kind = type(value)
    if kind in _LEAVES:
        return value
    if depth >= MAX_DEPTH:
        raise ValueError(f"a report nested more than {MAX_DEPTH} deep")
    depth += 1
    if kind is list:
        if _LEAVES.issuperset(map(type, value)):
            return value
        return [v if type(v) in _LEAVES else _plain(v, blobs, depth) for v in value]
    if isinstance(value, dict):
        if _STR.issuperset(map(type, value)) and TAG not in value:
            if kind is dict and _LEAVES.issuperset(map(type, value.values())):
                return value
            return {k: v if type(v) in _LEAVES else _plain(v, blobs, depth) for k, v in value.items()}
        return {TAG: "dict", "items": [[_plain(k, blobs, depth), _plain(v, blobs, depth)] for k, v in value.items()]}
    if kind is tuple:
        return {TAG: "tuple", "items": [v if type(v) in _LEAVES else _plain(v, blobs, depth) for v in value]}
    torch = sys.modules.get("torch")  # without torch, no value is one of its
    if torch is not None:
        if isinstance(value, torch.Tensor):
            return _tensor_header(value, blobs, torch)
        if kind is torch.Size:
            return {TAG: "size", "items": list(value)}
        if isinstance(value, (torch.dtype, torch.layout)):
            names = _torch_names()[1]
            if value not in names:
                raise TypeError(f"a report cannot carry {value}")
            return {TAG: "dtype" if isinstance(value, torch.dtype) else "layout", "name": names[value]}
        if isinstance(value, torch.device):
            return {TAG: "device", "name": str(value)}
    if isinstance(value, tuple):  # a named tuple, torch.return_types: a tuple
        return {TAG: "tuple", "items": [_plain(v, blobs, depth) for v in value]}
    if isinstance(value, list):
        return [_plain(v, blobs, depth) for v in value]
    if isinstance(value, (set, frozenset)):
        return {TAG: "frozenset" if isinstance(value, frozenset) else "set",
                "items": [_plain(v, blobs, depth) for v in value]}
    if isinstance(value, (bytes, bytearray)):
        blobs.append(value)
        return {TAG: "bytearray" if isinstance(value, bytearray) else "bytes", "n": len(value)}
    if kind is complex:
        return {TAG: "complex", "re": value.real, "im": value.imag}
    if isinstance(value, (str, int, float)):  # a subclass (an IntEnum, numpy's float64): its plain value
        return (str if isinstance(value, str) else float if isinstance(value, float) else int)(value)
    name = f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins.")
    raise TypeError(f"a report cannot carry a {name}: a driver returns plain data (CONTRIBUTING.md)")


def _tensor_header(t, blobs: list, torch) -> dict:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"a report cannot carry a {type(t).__name__} with layout {t.layout}: send a plain tensor")
    names = _torch_names()[1]
    if t.dtype not in names:
        raise TypeError(f"a report cannot carry a tensor of dtype {t.dtype}")
    flat = t.detach()
    if flat.device.type != "cpu" or not flat.is_contiguous() or flat.is_conj() or flat.is_neg():
        flat = flat.cpu().resolve_conj().resolve_neg().contiguous()
    n = flat.numel() * flat.element_size()
    if n:
        blobs.append(ctypes.string_at(flat.data_ptr(), n))  # its bytes, as they are in memory
    out = {TAG: "tensor", "dtype": names[t.dtype], "shape": list(t.shape), "n": n}
    if isinstance(t, torch.nn.Parameter):
        out["param"] = True
    if t.requires_grad:
        out["grad"] = True
    return out


# --- reading (in the grader) ------------------------------------------------------------------------


def loads(data, budget: Budget | None = None):
    """The value a message of :func:`dumps` carries, read within ``budget`` (charged; a fresh one when
    None); Unreadable for anything that is not such a message, or is over the budget."""
    budget = budget if budget is not None else Budget()
    view = memoryview(data)
    if len(view) < _HEAD or view[:len(MAGIC)] != MAGIC:
        raise Unreadable("not a message of the grader's wire (no 'DDPW' at its start): a pickle, or bytes that "
                         "something else wrote into the pipe")
    budget.charge(nbytes=len(view))
    size = int.from_bytes(view[len(MAGIC):_HEAD], "little")
    if size > len(view) - _HEAD:
        raise Unreadable(f"a header of {size:,} bytes in a message of {len(view):,}")
    header = bytes(view[_HEAD:_HEAD + size])
    reader = _Reader(view[_HEAD + size:], budget)
    value = parse_json(header, budget, reader.hook)
    if reader.offset != len(reader.data):
        raise Unreadable(f"{len(reader.data) - reader.offset:,} bytes of data that no value of the header claims")
    return value


def parse_json(text: bytes | str, budget: Budget | None = None, hook=None):
    """JSON text, parsed only after its nesting (at most MAX_JSON_DEPTH) and its values were counted
    outside its strings and charged to ``budget``; Unreadable otherwise. ``hook``: json's object_hook."""
    budget = budget if budget is not None else Budget()
    if isinstance(text, str):
        try:
            text = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise Unreadable(f"text that is not UTF-8: {exc}") from None
    depth, values = structure(text)
    if depth > MAX_JSON_DEPTH:
        raise Unreadable(f"JSON nested {depth:,} deep (at most {MAX_JSON_DEPTH} levels are read)")
    budget.charge(values=values)
    try:
        return json.loads(text.decode("utf-8"), object_hook=hook)
    except Unreadable:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, RuntimeError) as exc:
        raise Unreadable(f"{type(exc).__name__}: {str(exc)[:200]}") from None


_CHUNK = 2**20  # brackets looked at in one step (a few MiB of arrays, whatever the text's length)
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def structure(text: bytes) -> tuple[int, int]:
    """(how deep the JSON ``text`` nests at most, how many values it holds at most), counted outside its
    strings, in time linear in its length, in bounded memory and without recursion. Past MAX_JSON_DEPTH
    the depth is exact for valid JSON, and for anything else exact up to where a parser would refuse it."""
    # An escape is a backslash and the character after it; with every escaped backslash, then every
    # escaped quote removed, each quote left opens or closes a string.
    plain = text.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in text else text
    quotes = plain.count(b'"')
    if quotes > 2 * MAX_VALUES:  # more strings than any budget allows: not worth finding them
        return 0, quotes // 2
    outside = b"".join(plain.split(b'"')[::2]) if quotes else plain
    brackets = outside.translate(_BRACKETS, _NOT_BRACKETS)
    opens = brackets.count(b"[")
    values = 1 + opens + outside.count(b",") + outside.count(b":")
    if opens <= MAX_JSON_DEPTH:
        return opens, values  # at most that deep
    import numpy as np

    depth, level = 0, 0
    for start in range(0, len(brackets), _CHUNK):
        codes = np.frombuffer(brackets, dtype=np.int8, count=min(_CHUNK, len(brackets) - start), offset=start)
        levels = np.cumsum(np.where(codes == ord("["), 1, -1), dtype=np.int64) + level
        depth, level = max(depth, int(levels.max())), int(levels[-1])
    return depth, values


class _Reader:
    """json's object_hook: builds each tagged value, taking its bytes from the data in the header's order
    (a tagged object holds no other object, so json calls this in the order they were written)."""

    def __init__(self, data: memoryview, budget: Budget):
        self.data = data
        self.offset = 0
        self.budget = budget

    def take(self, n) -> memoryview:
        if type(n) is not int or n < 0 or n > len(self.data) - self.offset:
            raise Unreadable(f"a value that claims {n:,} bytes where {len(self.data) - self.offset:,} are left"
                             if type(n) is int else f"a value that claims {str(n)[:40]!r} bytes")
        piece = self.data[self.offset:self.offset + n]
        self.offset += n
        return piece

    def hook(self, obj: dict):
        kind = obj.get(TAG)
        if kind is None:
            return obj
        build = _BUILDERS.get(kind) if type(kind) is str else None
        if build is None:
            raise Unreadable(f"an unknown kind of value {str(kind)[:40]!r}")
        return build(self, obj)


def _fields(obj: dict, kind: str, required: tuple, optional: tuple = ()) -> None:
    if not all(key in obj for key in required) or len(obj) > 1 + len(required) + len(optional) or \
            any(key not in required and key not in optional and key != TAG for key in obj):
        raise Unreadable(f"a {kind} with fields {sorted(k for k in obj if k != TAG)[:8]}")


def _items(obj: dict, kind: str) -> list:
    _fields(obj, kind, ("items",))
    items = obj["items"]
    if type(items) is not list:
        raise Unreadable(f"a {kind} whose items are not a list")
    return items


def _distinct_hashes(keys: list, kind: str) -> None:
    """Refuse keys that share a hash beyond HASH_SLACK: built into a dict or set, n of them take n^2 steps."""
    try:
        hashes = set(map(hash, keys))
    except TypeError as exc:
        raise Unreadable(f"a {kind} with a key that cannot be one: {exc}") from None
    if len(keys) - len(hashes) > HASH_SLACK:
        raise Unreadable(f"a {kind} whose {len(keys):,} keys share {len(hashes):,} hashes")


def _tuple(reader, obj):
    return tuple(_items(obj, "tuple"))


def _set(reader, obj):
    items = _items(obj, obj[TAG])
    _distinct_hashes(items, obj[TAG])
    return (frozenset if obj[TAG] == "frozenset" else set)(items)


def _dict(reader, obj):
    pairs = _items(obj, "dict")
    if not all(type(p) is list and len(p) == 2 for p in pairs):
        raise Unreadable("a dict whose items are not [key, value] pairs")
    _distinct_hashes([p[0] for p in pairs], "dict")
    return dict(pairs)


def _bytes(reader, obj):
    _fields(obj, obj[TAG], ("n",))
    piece = reader.take(obj["n"])
    return bytearray(piece) if obj[TAG] == "bytearray" else bytes(piece)


def _tensor(reader, obj):
    import torch

    _fields(obj, "tensor", ("dtype", "shape", "n"), ("grad", "param"))
    dtype = _torch_names()[0].get(obj["dtype"]) if type(obj["dtype"]) is str else None
    if not isinstance(dtype, torch.dtype):
        raise Unreadable(f"a tensor of an unknown dtype {str(obj['dtype'])[:40]!r}")
    shape = obj["shape"]
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d < 2**62 for d in shape):
        raise Unreadable(f"a tensor whose shape is not {MAX_DIMS} sizes or fewer: {str(shape)[:80]}")
    numel = math.prod(shape)
    needed = numel * dtype.itemsize
    if obj["n"] != needed:
        raise Unreadable(f"a tensor of dtype {obj['dtype']} and shape {shape} needs {needed:,} bytes, and its "
                         f"storage has {obj['n']!r}: a storage that does not match its shape")
    reader.budget.charge(elements=numel)
    piece = reader.take(needed)
    if dtype is torch.bool and needed:
        t = torch.frombuffer(bytearray(piece), dtype=torch.uint8).clamp_(max=1).view(dtype).view(shape)  # 0 or 1
    elif needed:
        t = torch.frombuffer(bytearray(piece), dtype=dtype).view(shape)
    else:
        t = torch.empty(shape, dtype=dtype)
    grad, param = obj.get("grad", False), obj.get("param", False)
    if type(grad) is not bool or type(param) is not bool:
        raise Unreadable("a tensor whose flags are not true or false")
    if param:
        return torch.nn.Parameter(t, requires_grad=grad and (dtype.is_floating_point or dtype.is_complex))
    if grad and (dtype.is_floating_point or dtype.is_complex):  # only those can require grad
        t.requires_grad_()
    return t


def _named(kind: str):
    def build(reader, obj):
        import torch

        _fields(obj, kind, ("name",))
        value = _torch_names()[0].get(obj["name"]) if type(obj["name"]) is str else None
        if not isinstance(value, torch.dtype if kind == "dtype" else torch.layout):
            raise Unreadable(f"an unknown {kind} {str(obj['name'])[:40]!r}")
        return value
    return build


def _size(reader, obj):
    import torch

    items = _items(obj, "torch.Size")
    if not all(type(d) is int for d in items):
        raise Unreadable("a torch.Size of other things than integers")
    return torch.Size(items)


def _device(reader, obj):
    import torch

    _fields(obj, "device", ("name",))
    name = obj["name"]
    if type(name) is not str or len(name) > 64:
        raise Unreadable("a device that is not a short name")
    try:
        return torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise Unreadable(f"not a device: {str(exc)[:100]}") from None


def _complex(reader, obj):
    _fields(obj, "complex", ("re", "im"))
    if type(obj["re"]) not in (int, float) or type(obj["im"]) not in (int, float):
        raise Unreadable("a complex number whose parts are not numbers")
    return complex(obj["re"], obj["im"])


_BUILDERS = {"tuple": _tuple, "set": _set, "frozenset": _set, "dict": _dict, "bytes": _bytes,
             "bytearray": _bytes, "tensor": _tensor, "dtype": _named("dtype"), "size": _size,
             "device": _device, "layout": _named("layout"), "complex": _complex}


# --- frames: how the sandbox's host and the grader outside take turns (grader.sandbox.confined) ---------

HEADER = struct.Struct("!Q")  # the length of a frame
MAX_REQUEST_BYTES = 64 * 2**20  # one request to the host (a run's arguments)


def read_frame(stream, limit: int = MAX_REQUEST_BYTES) -> bytes | None:
    """One frame from a blocking ``stream``; None at its end, or when the length is over ``limit``
    (the stream was written into by something else: nothing after it can be trusted to be framed)."""
    header = _read_exactly(stream, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > limit:
        return None
    return _read_exactly(stream, size)


def _read_exactly(stream, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload
