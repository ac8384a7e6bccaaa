"""How to grade, as one value: the options every grading command shares, and the exit codes.

The command line builds one :class:`GradeOptions` from ``--world-size``, ``--backend``,
``--timeout`` and the limits (see :mod:`grader.limits`); it travels from the command to
:func:`grader.grading.grade_file` and to the :class:`~grader.harness.Session` that runs the
ranks. Nothing is kept in a module global.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import click

from grader import limits as _limits

DEFAULT_TIMEOUT_S = 60.0

# The exit codes live in grader.exits (plain data); commands import them from here too.
from grader.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_TIMEOUT, EXIT_UNUSABLE  # noqa: E402,F401


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


def grading_options(f):
    """--world-size, --backend, --timeout and the limits, given to the command as one ``options``."""

    @functools.wraps(f)
    def command(*args, world_size, backend, timeout_s, memory_limit, cpu_limit, output_limit, tmp_limit, **kwargs):
        options = GradeOptions(world_size=world_size, backend=backend, timeout_s=timeout_s,
                               limits=_limits.limits_dict(memory_limit, cpu_limit, output_limit, tmp_limit))
        return f(*args, options=options, **kwargs)

    command = _limits.limit_options(command)
    command = click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=DEFAULT_TIMEOUT_S,
                           show_default=True,
                           help="Seconds for grading one file; a run past it is stopped (exit 3).")(command)
    command = click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto",
                           show_default=True, help="auto: nccl when there is one GPU per rank, else gloo.")(command)
    command = click.option("--world-size", "world_size", type=click.IntRange(min=1, max=64), default=None,
                           help="Ranks per run (default: the exercise's, 2; an odd size is tried too where it "
                                "matters).")(command)
    return command


def format_option(*choices: str):
    """--format with these choices (the first is the default)."""
    choices = choices or ("text", "json")

    def decorate(f):
        return click.option("--format", "fmt", type=click.Choice(list(choices)), default=choices[0],
                            show_default=True, help="json: the machine-readable report (docs/results-schema.md).")(f)

    return decorate


def quiet_option(f):
    return click.option("-q", "--quiet", is_flag=True, help="No live progress line on stderr while grading.")(f)
