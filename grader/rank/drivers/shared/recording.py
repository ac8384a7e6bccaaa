"""What a driver records, done the same way in every exercise (runs in a rank): a tensor as a plain CPU
tensor, whether every rank is ok, a module's state. An exception the learner's code raised is recorded in
words with its frame by :func:`grader.rank.drivers.shared.learner_errors.learner_error`."""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn

from grader.rank import rank_timeline

JOURNAL_LIMIT = 5000  # notes of messages a rank writes at most (a runaway loop must not fill the disk)
SENDS_AND_RECEIVES = ("send", "recv_", "recv_any_source_")  # as c10d's dispatched operations are named


def plain_tensor(value):
    """A tensor as a plain CPU tensor (a functional collective's result is a subclass, a DTensor gives this
    rank's part); None as None; anything else described ("a list")."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}"
    if hasattr(value, "to_local"):  # a DTensor: this rank's part
        value = value.to_local()
    out = torch.empty(value.shape, dtype=value.dtype)
    out.copy_(value.detach().to("cpu"))
    return out


def all_ok(ok: bool, device="cpu", group=None) -> bool:
    """Whether every rank of ``group`` is ok (so that all go on, e.g. to backward, or none does)."""
    flag = torch.tensor([1 if ok else 0], device=device)
    with rank_timeline.by_grader():  # the grader's own all-reduce: drawn apart from the learner's
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def cpu_state(module: nn.Module) -> dict:
    """A copy of ``module``'s state_dict on the CPU, detached: what it holds now, whatever it does next."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def journal_name(rank: int) -> str:
    """The file in the run's folder where rank ``rank`` notes its messages (:class:`MessageJournal`)."""
    return f"rank{rank}.messages"


class MessageJournal:
    """Each send and receive this rank is about to post, one JSON line in the run's folder, written before the
    message goes: gloo aborts a process whose receive meets a message of another size, its record lost with
    it, and the notes survive it (the grader reads them: grader.checks.shared.mismatch)."""

    def __init__(self, run_dir: str, rank: int):
        self.fd = os.open(os.path.join(run_dir, journal_name(rank)), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.count = 0

    def message(self, op: str, peer, args, phase: str, name_of=None) -> None:
        """Note a dispatched send or receive before it runs (c10d's send and recv_ take (tensors, group, peer,
        tag)): its peer (a global rank), tag, bytes, dtype, shape, and what the tensor is (``name_of``)."""
        if op not in SENDS_AND_RECEIVES or self.count >= JOURNAL_LIMIT:
            return
        tensors = args[0] if args else None
        tensor = tensors[0] if isinstance(tensors, (list, tuple)) and tensors and \
            isinstance(tensors[0], torch.Tensor) else None
        tag = args[3] if op != "recv_any_source_" and len(args) > 3 and type(args[3]) is int else 0
        entry = {"phase": phase, "op": op, "peer": peer, "tag": tag, "bytes": 0, "dtype": None, "shape": None,
                 "what": None}
        if tensor is not None:
            entry.update(bytes=tensor.numel() * tensor.element_size(), dtype=str(tensor.dtype).removeprefix("torch."),
                         shape=list(tensor.shape))
            with contextlib.suppress(Exception):  # the grader's note must never fail the learner's call
                entry["what"] = name_of(tensor) if name_of is not None else None
        self.count += 1
        with contextlib.suppress(OSError, TypeError, ValueError):
            os.write(self.fd, (json.dumps(entry) + "\n").encode())

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def storage_words(named: dict[str, torch.Tensor]) -> "callable":
    """``name_of`` for a :class:`MessageJournal`: a tensor's words when it is one of ``named`` ({words: tensor}),
    or a view of one (the same storage), else None."""
    exact = {(t.untyped_storage().data_ptr(), t.data_ptr(), t.numel()): words for words, t in named.items()
             if t.numel()}
    storages = {t.untyped_storage().data_ptr(): words for words, t in named.items() if t.numel()}

    def name_of(tensor: torch.Tensor) -> str | None:
        if not tensor.numel() or tensor.device.type == "meta":
            return None
        storage = tensor.untyped_storage().data_ptr()
        found = exact.get((storage, tensor.data_ptr(), tensor.numel()))
        if found is not None:
            return found
        return f"part of {storages[storage]}" if storage in storages else None

    return name_of
