"""How to grade, as one value: what the options every grading command shares said.

The command line builds one :class:`GradeOptions` from ``--world-size``, ``--backend``,
``--timeout`` and the limits (see :mod:`grader.rank.limits`, and :mod:`grader.cli.options` for the
options themselves); it travels from the command to
:func:`grader.grading.grade_file` and to the :class:`~grader.rank.harness.Session` that runs the
ranks. Nothing is kept in a module global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grader.rank import limits as _limits

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class GradeOptions:
    """How to grade one file: what the command line said."""

    world_size: int | None = None  # None: the exercise's default sizes
    backend: str = "auto"  # auto, gloo or nccl
    timeout_s: float = DEFAULT_TIMEOUT_S  # for the whole grading of one file
    limits: dict = field(default_factory=lambda: dict(_limits.DEFAULT_LIMITS))  # per rank process

    def to_dict(self) -> dict:
        """Plain data, e.g. to send to a batch worker."""
        return {"world_size": self.world_size, "backend": self.backend, "timeout_s": self.timeout_s,
                "limits": dict(self.limits)}

    @classmethod
    def from_dict(cls, data: dict) -> "GradeOptions":
        return cls(world_size=data.get("world_size"), backend=data.get("backend", "auto"),
                   timeout_s=float(data.get("timeout_s", DEFAULT_TIMEOUT_S)),
                   limits={**_limits.DEFAULT_LIMITS, **(data.get("limits") or {})})
