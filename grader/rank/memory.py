"""What a rank holds in memory, measured from the storages actually alive (runs in a rank).

Attributes can say anything; what counts is memory. These helpers find the tensors a
learner's object keeps (by walking Python references from it), the tensors autograd
saved for backward (which no Python reference reaches), and the storages behind both,
each counted once; and they look for known values in those storages, byte for byte,
so that a copy is found wherever it lives (a view, a flat buffer, a closure).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import types

import torch

MAX_WALK = 200_000  # objects visited by one walk, at most

_SKIPPED = (types.ModuleType, types.FrameType, types.CodeType, str, bytes, int, float, complex, bool)


def reachable_tensors(roots: list, learner_module: str) -> list[torch.Tensor]:
    """Every tensor reachable from ``roots``: attributes, containers, hooks and their closures, .grad.

    The walk enters functions' and classes' namespaces only for the learner's module
    (``learner_module``, its ``__name__``), never other modules, so torch and the grader
    stay out of it.
    """
    seen: set[int] = set()
    stack = list(roots)
    tensors: list[torch.Tensor] = []
    while stack and len(seen) < MAX_WALK:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            try:
                if obj.is_leaf and obj.grad is not None:
                    stack.append(obj.grad)
            except RuntimeError:  # a view changed in place under no_grad: autograd refuses to rebuild its grad_fn
                pass
            for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
                hooks = getattr(obj, name, None)
                if hooks:
                    stack.append(hooks)
            stack.extend(getattr(obj, "__dict__", {}).values())
            if hasattr(type(obj), "__tensor_flatten__"):  # a wrapper subclass (DTensor): the tensors inside
                try:
                    inner, _ = obj.__tensor_flatten__()
                    stack.extend(getattr(obj, name) for name in inner)
                except Exception:
                    pass
        elif isinstance(obj, _SKIPPED):
            continue
        elif isinstance(obj, type):
            if obj.__module__ == learner_module:
                stack.extend(vars(obj).values())
        elif isinstance(obj, types.FunctionType):
            stack.extend(_function_references(obj, learner_module))
        else:
            stack.extend(gc.get_referents(obj))
    return tensors


def _function_references(function: types.FunctionType, learner_module: str) -> list:
    out = []
    for cell in function.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    out.extend(function.__defaults__ or ())
    out.extend((function.__kwdefaults__ or {}).values())
    if function.__module__ == learner_module:
        out.append(function.__globals__)
    return out


def running_locals(filename: str) -> list:
    """The local variables of the functions of ``filename`` now running in this thread (e.g. a forward)."""
    filename = os.path.abspath(filename)
    out = []
    frame = sys._getframe(1)
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename) == filename:
            out.extend(frame.f_locals.values())
        frame = frame.f_back
    return out


def distinct_storages(tensors: list) -> dict[int, torch.UntypedStorage]:
    """The storages of ``tensors``, once each, by address (empty ones left out)."""
    out = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
            if storage.nbytes() > 0:
                out[storage.data_ptr()] = storage
        except (RuntimeError, NotImplementedError, TypeError):  # no storage of its own (sparse, meta, DTensor)
            continue
    return out


def held_bytes(roots: list, learner_module: str) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``roots``."""
    return sum(s.nbytes() for s in distinct_storages(reachable_tensors(roots, learner_module)).values())


def storage_bytes(storage: torch.UntypedStorage) -> bytes:
    """A copy of the storage's bytes (numpy() on the storage itself would make it impossible to resize)."""
    data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return data.to("cpu", copy=True).numpy().tobytes()


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of a tensor's values, in order: what a copy of it holds contiguously."""
    return tensor.detach().to("cpu", copy=True).contiguous().numpy().tobytes()


def found_in(contents: list[bytes], fingerprints: dict[str, bytes]) -> list[str]:
    """The names whose bytes lie, whole and in order, in one of ``contents``."""
    return [name for name, fingerprint in fingerprints.items() if any(fingerprint in raw for raw in contents)]


@contextlib.contextmanager
def watch_saved(refs: list):
    """Record a weak reference to the storage of every tensor autograd saves for backward in the block.

    Autograd keeps those tensors from C++, out of reach of any Python walk; with
    :func:`saved_storages` the ones still alive can be read later (during backward too).
    """
    from torch.multiprocessing.reductions import StorageWeakRef

    def pack(tensor):
        refs.append(StorageWeakRef(tensor.untyped_storage()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield refs


def saved_storages(refs: list) -> dict[int, torch.UntypedStorage]:
    """The storages of :func:`watch_saved`'s records still alive and not empty, by address."""
    out = {}
    for ref in refs:
        if ref.expired():
            continue
        storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        if storage is not None and storage.nbytes() > 0:
            out[storage.data_ptr()] = storage
    return out
