"""A checkpoint a rank saved with ``torch.save``, read in the grader so that nothing in it can crash the
grader, run its code, or make it allocate more than a small multiple of the file.

``torch.load(weights_only=True)`` runs no code of the file's, but alone it is not enough: its allowlist
has ``bytearray`` (a pickle of a few bytes asks for gigabytes, zeroed), its unpickler builds tuples
nested as deep as the file says (a dict key nested 10^7 deep makes ``hash()`` recurse in C until the
process dies), its zip reader inflates compressed records (a small file, a large storage), and a
tensor it rebuilds may view its storage with a stride of 0 (eight bytes that claim 10^9 elements, which
a check's ``.clone()`` or ``.tolist()`` would make real). So, before and after it:

1. the file is a zip of stored (uncompressed) records, at most :data:`MAX_RECORDS` of them, their sizes
   within the file's, with one ``data.pkl`` of at most :data:`MAX_PICKLE_BYTES`;
2. the pickle's instructions are walked without running them (:func:`check_pickle`): only those the
   weights-only unpickler reads, only the globals a state dict needs (:data:`GLOBALS`; no
   ``bytearray``, no tensor constructor), nothing nested deeper than :data:`MAX_DEPTH`, no dict with
   more than :data:`MAX_ODD_KEYS` keys other than strings and small integers (keys made to collide);
3. ``torch.load(weights_only=True)`` reads a zip the grader wrote itself from the records it checked
   (what was checked is what is read: no two zip readers disagree about the file);
4. what it returns is walked (at most :data:`MAX_VALUES` values, shared parts counted each time): every
   tensor a plain strided tensor whose elements fit in its storage, all of them together at most
   :data:`GROWTH` times the file's bytes.

Each refusal is :class:`Refused`, whose message says what was wrong. Reading the file (without
following links, at most a given size) is :func:`grader.rank.untrusted.load_tensors`'s.
"""

from __future__ import annotations

import io
import pickletools
import zipfile

MAX_RECORDS = 10_000
MAX_PICKLE_BYTES = 2**20
MAX_DEPTH = 64
MAX_ODD_KEYS = 1_000
MAX_VALUES = 1_000_000
GROWTH = 2  # the tensors of a checkpoint hold at most this many times the file's bytes (plus a MiB)

# Globals a state dict, an optimizer's state and a training step's counters need, and what each may be:
# a callable (REDUCE, NEWOBJ) or only a value (a storage's type in a persistent id, a dtype).
_CALLABLE = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
             "torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state",
             "torch._tensor._rebuild_from_type_v2", "torch.Size", "torch.device", "_codecs.encode",
             "builtins.complex"}
_STORAGES = {f"torch.{kind}Storage" for kind in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short",
                                                    "Char", "Byte", "Bool", "ComplexFloat", "ComplexDouble")}
_DTYPES = {f"torch.{name}" for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
                                        "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
                                        "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                        "float8_e5m2fnuz")}
GLOBALS = _CALLABLE | _STORAGES | _DTYPES | {"torch.storage.UntypedStorage", "torch.storage.TypedStorage",
                                             "torch.Tensor", "torch.nn.parameter.Parameter"}

_ATOMS = {"NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE",
          "SHORT_BINSTRING", "LONG1"}
_PLAIN_KEYS = {"NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "BINUNICODE", "SHORT_BINSTRING"}
_EMPTY = {"EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"}
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


class Refused(ValueError):
    """A checkpoint the grader does not load; the message says why."""


def load(data: bytes):
    """What ``torch.save`` wrote into ``data``, loaded on the CPU with ``weights_only=True`` after the
    checks above (Refused otherwise)."""
    import torch

    archive = repacked(data)
    try:
        value = torch.load(io.BytesIO(archive), map_location="cpu", weights_only=True)
    except Exception as exc:  # a torn record, a storage of another size than its pickle says
        raise Refused(f"torch.load(weights_only=True) refused it: {type(exc).__name__}: {str(exc)[:300]}") from None
    check_loaded(value, GROWTH * len(data) + 2**20)
    return value


def repacked(data: bytes) -> bytes:
    """The records of the zip ``data``, checked (stored, sized within the file, one pickle that
    :func:`check_pickle` accepts), written into a zip of the grader's own."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        records = archive.infolist()
        if len(records) > MAX_RECORDS:
            raise Refused(f"a zip of {len(records):,} records (at most {MAX_RECORDS:,} are read)")
        if any(r.compress_type != zipfile.ZIP_STORED or r.file_size != r.compress_size for r in records):
            raise Refused("a compressed record: torch.save stores its records as they are, and a compressed one "
                          "may inflate to any size")
        if sum(r.file_size for r in records) > len(data) or len({r.filename for r in records}) != len(records):
            raise Refused("records that claim more bytes than the file has, or two records of one name")
        pickles = [r for r in records if r.filename.endswith("/data.pkl") and r.filename.count("/") == 1]
        if len(pickles) != 1 or pickles[0].file_size > MAX_PICKLE_BYTES:
            raise Refused(f"not one data.pkl of at most {MAX_PICKLE_BYTES:,} bytes")
        prefix = pickles[0].filename.split("/")[0] + "/"
        if not all(r.filename.startswith(prefix) for r in records):
            raise Refused("records outside the checkpoint's folder")
        check_pickle(archive.read(pickles[0]))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as copy:
            for record in records:
                copy.writestr(record.filename, archive.read(record))
        return out.getvalue()
    except Refused:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, KeyError,
            NotImplementedError, RuntimeError) as exc:
        raise Refused(f"not a zip that torch.save writes: {type(exc).__name__}: {str(exc)[:200]}") from None


def check_pickle(pickle: bytes) -> None:
    """Walk the pickle's instructions without running them; Refused for one that torch's weights-only
    unpickler does not read, a global outside GLOBALS (or called when it is only a value), nesting
    past MAX_DEPTH, or a dict given more than MAX_ODD_KEYS keys other than strings and small integers.

    Each value on the simulated stack is ``[depth, global name or None, plain key, odd keys given]``;
    a container's depth grows as it is filled (the same list is in the memo: a later fill counts too)."""
    import _compat_pickle

    stack: list[list] = []
    marks: list[int] = []
    memo: dict[int, list] = {}

    def pop(n: int = 1) -> list[list]:
        if n > len(stack) - (marks[-1] if marks else 0):
            raise Refused("a pickle that takes more from its stack than it put there")
        taken = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return taken

    def to_mark() -> list[list]:
        if not marks:
            raise Refused("a pickle that closes a mark it never opened")
        start = marks.pop()
        taken = stack[start:]
        del stack[start:]
        return taken

    def top() -> list:
        if len(stack) <= (marks[-1] if marks else 0):
            raise Refused("a pickle that works on an empty stack")
        return stack[-1]

    def fill(container: list, items: list[list], keys: list[list] = ()) -> None:
        container[0] = max([container[0]] + [item[0] + 1 for item in items])
        container[3] += sum(1 for key in keys if not key[2])
        if container[3] > MAX_ODD_KEYS:
            raise Refused(f"a dict given more than {MAX_ODD_KEYS:,} keys that are neither text nor small integers")
        if container[0] > MAX_DEPTH:
            raise Refused(f"values nested more than {MAX_DEPTH} deep")

    def new(depth: int, name=None, plain=False) -> None:
        if depth > MAX_DEPTH:
            raise Refused(f"values nested more than {MAX_DEPTH} deep")
        stack.append([depth, name, plain, 0])

    try:
        for op, arg, _ in pickletools.genops(pickle):
            kind = op.name
            if kind in _ATOMS:
                plain = kind in _PLAIN_KEYS or kind == "LONG1" and abs(arg) < 2**61
                new(0, plain=plain)
            elif kind in ("BINPUT", "LONG_BINPUT"):
                memo[arg] = top()
            elif kind in ("BINGET", "LONG_BINGET"):
                if arg not in memo:
                    raise Refused("a pickle that reads a memo it never wrote")
                stack.append(memo[arg])
            elif kind == "MARK":
                marks.append(len(stack))
            elif kind in _EMPTY:
                new(1)
            elif kind == "TUPLE":
                items = to_mark()
                new(1 + max((i[0] for i in items), default=0))  # a tuple key is odd: tuples can collide
            elif kind in _TUPLES:
                items = pop(_TUPLES[kind])
                new(1 + max(i[0] for i in items))
            elif kind == "APPEND":
                item = pop()
                fill(top(), item)
            elif kind == "APPENDS":
                items = to_mark()
                fill(top(), items)
            elif kind == "SETITEM":
                key, value = pop(2)
                fill(top(), [key, value], [key])
            elif kind == "SETITEMS":
                items = to_mark()
                if len(items) % 2:
                    raise Refused("a pickle that sets a key without a value")
                fill(top(), items, items[0::2])
            elif kind == "GLOBAL":
                module, _, name = arg.partition(" ")
                module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
                module = _compat_pickle.IMPORT_MAPPING.get(module, module)
                if f"{module}.{name}" not in GLOBALS:
                    raise Refused(f"a pickle that names {module}.{name}, which no state dict needs")
                new(0, f"{module}.{name}")
            elif kind in ("REDUCE", "NEWOBJ"):
                (args,) = pop()
                function = top()
                if function[1] not in _CALLABLE:
                    raise Refused(f"a pickle that calls {function[1] or 'something that is not a global'}")
                stack[-1] = [args[0] + 1, None, False, 0]
                if stack[-1][0] > MAX_DEPTH:
                    raise Refused(f"values nested more than {MAX_DEPTH} deep")
            elif kind == "BUILD":
                state = pop()
                fill(top(), state)
            elif kind == "BINPERSID":
                pop()
                new(0)
            elif kind in ("PROTO", "STOP"):
                pass
            else:
                raise Refused(f"a pickle instruction ({kind}) that torch.load(weights_only=True) does not read")
    except Refused:
        raise
    except (ValueError, EOFError, IndexError) as exc:  # genops on a torn or malformed pickle
        raise Refused(f"a pickle that cannot be read: {type(exc).__name__}: {str(exc)[:200]}") from None


def check_loaded(value, most_bytes: int) -> None:
    """Refused unless every tensor in ``value`` is a plain strided tensor whose elements fit in its storage,
    all of them holding at most ``most_bytes`` together, in at most MAX_VALUES values (walked without
    recursion; a part reached twice counts twice)."""
    import torch

    todo, seen, held = [value], 0, 0
    while todo:
        item = todo.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise Refused(f"more than {MAX_VALUES:,} values (shared parts counted each time they are reached)")
        if isinstance(item, torch.Tensor):
            if type(item) not in (torch.Tensor, torch.nn.Parameter) or item.layout != torch.strided \
                    or item.is_quantized or item.device.type != "cpu":
                raise Refused(f"a {type(item).__name__} of layout {item.layout}: a checkpoint of plain tensors was "
                              "expected")
            size = item.numel() * item.element_size()
            if size > item.untyped_storage().nbytes():
                raise Refused(f"a tensor of shape {list(item.shape)} viewing a storage of "
                              f"{item.untyped_storage().nbytes():,} bytes (its strides repeat elements)")
            held += size
            if held > most_bytes:
                raise Refused(f"tensors of more than {most_bytes:,} bytes in all, in a file of fewer")
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            todo.extend(item)
