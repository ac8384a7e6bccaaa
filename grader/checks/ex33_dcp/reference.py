"""Exercise 33, grader side: the parameters' shapes, and which are large enough to be looked for in memory."""

from __future__ import annotations

from grader.rank.drivers.ex33_dcp import FINGERPRINT_BYTES, build_model


def shapes() -> dict:
    return {name: tuple(p.shape) for name, p in build_model().named_parameters()}


def large_parameters() -> list[str]:
    return [name for name, p in build_model().named_parameters() if p.numel() * p.element_size() >= FINGERPRINT_BYTES]
