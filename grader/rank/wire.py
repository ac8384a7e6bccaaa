"""How a rank's report travels to the grader: a pickle that the grader reads with an allowlist.

A report is plain data (dicts, lists, tuples, strings, numbers, bytes, sets) and tensors. The
rank writes each tensor as its dtype, shape and bytes; the grader's unpickler rebuilds only
what :data:`ALLOWED` names, so nothing a submission puts in a report can run code in the
grader. This is the guarantee ``torch.load(weights_only=True)`` gave, at a fraction of its cost:
that loader is written in Python, and a small report took it about a millisecond.
Tensors arrive on the CPU, detached, as plain tensors or parameters.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import struct

import torch


class _Writer(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            return _tensor, _describe(obj)
        return NotImplemented


def dumps(payload) -> bytes:
    """``payload`` as bytes for :func:`loads`; raises TypeError for a tensor it cannot carry."""
    buffer = io.BytesIO()
    _Writer(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return buffer.getvalue()


def _describe(t: torch.Tensor) -> tuple:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"a report cannot carry a {type(t).__name__} with layout {t.layout}: send a plain tensor")
    flat = t.detach().cpu().reshape(-1).contiguous()
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return (str(t.dtype).removeprefix("torch."), tuple(t.shape), data, t.requires_grad,
            isinstance(t, torch.nn.Parameter))


def _tensor(dtype: str, shape: tuple, data: bytes, requires_grad: bool, parameter: bool) -> torch.Tensor:
    """Rebuild a tensor written by :func:`_describe`, checking every field (they come from a rank)."""
    kind = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(kind, torch.dtype):
        raise pickle.UnpicklingError(f"not a dtype: {dtype!r}")
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise pickle.UnpicklingError(f"not a shape: {shape!r}")
    size = math.prod(shape) * kind.itemsize
    if not isinstance(data, bytes) or len(data) != size:
        raise pickle.UnpicklingError(f"a {dtype} tensor of shape {shape} needs {size} bytes")
    if size:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)
    else:
        t = torch.empty(shape, dtype=kind)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=bool(requires_grad))
    if requires_grad and (kind.is_floating_point or kind.is_complex):  # only those can require grad
        t.requires_grad_()
    return t


ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "Counter"): collections.Counter,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "complex"): complex,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # torch.strided and the like
    (__name__, "_tensor"): _tensor,
}


class _Reader(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"a report may not hold {module}.{name}")


def loads(data: bytes):
    """What :func:`dumps` wrote; raises pickle.UnpicklingError for anything outside ALLOWED."""
    return _Reader(io.BytesIO(data)).load()


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
