"""The options several commands share, as click decorators: how to grade (``--world-size``, ``--backend``,
``--timeout`` and the limits, given to the command as one :class:`grader.options.GradeOptions`), ``--format``
and ``-q``."""

from __future__ import annotations

import functools

import click

from grader.rank import limits as _limits
from grader.rank.limits import DEFAULT_CPU_SECONDS, DEFAULT_MEMORY_MIB, DEFAULT_OUTPUT_MIB, DEFAULT_TMP_MIB
from grader.options import DEFAULT_TIMEOUT_S, GradeOptions


def grading_options(f):
    """--world-size, --backend, --timeout and the limits, given to the command as one ``options``."""

    @functools.wraps(f)
    def command(*args, world_size, backend, timeout_s, memory_limit, cpu_limit, output_limit, tmp_limit, **kwargs):
        options = GradeOptions(world_size=world_size, backend=backend, timeout_s=timeout_s,
                               limits=_limits.limits_dict(memory_limit, cpu_limit, output_limit, tmp_limit))
        return f(*args, options=options, **kwargs)

    command = limit_options(command)
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


def limit_options(f):
    """--memory-limit, --cpu-limit, --output-limit, --tmp-limit for a command that grades.

    They reach the command as ``memory_limit`` (MiB), ``cpu_limit`` (s), ``output_limit`` and
    ``tmp_limit`` (MiB); :func:`grading_options` turns them into one ``GradeOptions``.
    """
    f = click.option("--tmp-limit", "tmp_limit", type=click.FloatRange(min=0), default=DEFAULT_TMP_MIB,
                     show_default=True, metavar="MIB",
                     help="In a sandbox (--sandbox, batch): the size of its /tmp and of its /dev/shm, in MiB each.")(f)
    f = click.option("--output-limit", "output_limit", type=click.FloatRange(min=0), default=DEFAULT_OUTPUT_MIB,
                     show_default=True, metavar="MIB",
                     help="Largest file (printed output included) a rank may write, in MiB; 0: no limit.")(f)
    f = click.option("--cpu-limit", "cpu_limit", type=click.FloatRange(min=0), default=DEFAULT_CPU_SECONDS,
                     show_default=True, metavar="SECONDS",
                     help="CPU time per rank process, in seconds; 0: no limit.")(f)
    f = click.option("--memory-limit", "memory_limit", type=click.FloatRange(min=0), default=DEFAULT_MEMORY_MIB,
                     show_default=True, metavar="MIB",
                     help="Resident memory per rank process, in MiB; 0: no limit.")(f)
    return f
