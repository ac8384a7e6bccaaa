"""Compare tensors in the grader's process: how far apart, where, and relative to what.

Every check that compares a learner's tensors with the grader's reference uses these,
so a failure message always reads the same way: which tensor, the largest absolute
difference, at which index, and how large that is relative to the expected values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Difference:
    """How one tensor (or one entry of a dict of tensors) differs from what was expected."""

    name: str  # the key in a dict of tensors; "" for a lone tensor
    reason: str  # "values", "shape", "dtype", "missing", "unexpected" or "not a tensor"
    max_abs: float = float("inf")  # the largest absolute difference (inf when not comparable)
    index: tuple[int, ...] | None = None  # where the largest difference is
    relative: float = float("inf")  # max_abs / the largest |expected| value (or max_abs when that is 0)
    got: str = ""  # for shape/dtype reasons: what was there
    expected: str = ""  # and what was expected

    def describe(self) -> str:
        """"'fc.weight' differs by up to 0.031 at [2, 0] (relative 0.4%)" and the like."""
        what = f"{self.name!r}" if self.name else "the tensor"
        if self.reason == "missing":
            return f"{what} is missing"
        if self.reason == "unexpected":
            return f"{what} was not expected"
        if self.reason in ("shape", "dtype", "not a tensor"):
            return f"{what} has {self.reason} {self.got}, expected {self.expected}"
        where = f" at {list(self.index)}" if self.index else ""
        return f"{what} differs by up to {self.max_abs:.3g}{where} (relative {self.relative:.2g})"

    def __str__(self) -> str:
        return self.describe()


def tensor_difference(got, expected: torch.Tensor, *, rtol: float = 0.0, atol: float = 0.0, name: str = "",
                      check_dtype: bool = False) -> Difference | None:
    """None when ``got`` equals ``expected`` (exactly when both tolerances are 0), else the difference.

    Values are compared in float64 after moving both to the CPU, so dtypes can differ unless
    ``check_dtype`` asks for the same dtype.
    """
    if not isinstance(got, torch.Tensor):
        return Difference(name, "not a tensor", got=type(got).__name__, expected="Tensor")
    if tuple(got.shape) != tuple(expected.shape):
        return Difference(name, "shape", got=str(list(got.shape)), expected=str(list(expected.shape)))
    if check_dtype and got.dtype != expected.dtype:
        return Difference(name, "dtype", got=str(got.dtype), expected=str(expected.dtype))
    a = got.detach().to("cpu")
    b = expected.detach().to("cpu")
    if rtol == 0.0 and atol == 0.0:
        same = torch.equal(a.to(b.dtype), b) if a.dtype != b.dtype else torch.equal(a, b)
    else:
        same = torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True)
    if same:
        return None
    diff = (a.double() - b.double()).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    if diff.numel() == 0:
        return Difference(name, "values", 0.0)
    flat = int(diff.argmax())
    max_abs = float(diff.reshape(-1)[flat])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
    scale = float(b.double().abs().max()) if b.numel() else 0.0
    relative = max_abs / scale if scale > 0 else max_abs
    return Difference(name, "values", max_abs, index, relative)


def first_difference(got: dict, expected: dict, *, rtol: float = 0.0, atol: float = 0.0,
                     extra_ok: bool = False) -> Difference | None:
    """The first entry of ``expected`` (in its order) that ``got`` lacks or holds differently.

    Keys in ``got`` that ``expected`` lacks count as a difference unless ``extra_ok``.
    """
    if not isinstance(got, dict):
        return Difference("", "not a tensor", got=type(got).__name__, expected="dict of tensors")
    for key, value in expected.items():
        if key not in got:
            return Difference(str(key), "missing")
        found = tensor_difference(got[key], value, rtol=rtol, atol=atol, name=str(key))
        if found is not None:
            return found
    if not extra_ok:
        for key in got:
            if key not in expected:
                return Difference(str(key), "unexpected")
    return None


def largest_difference(got: dict, expected: dict) -> Difference | None:
    """Over every shared key, the entry with the largest absolute difference (None when all equal)."""
    worst = None
    for key, value in expected.items():
        if key not in got:
            return Difference(str(key), "missing")
        found = tensor_difference(got[key], value, name=str(key))
        if found is not None and (worst is None or found.max_abs > worst.max_abs):
            worst = found
    return worst
