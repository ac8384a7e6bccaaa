"""Limits for the learner's processes: memory, CPU time and output, with their defaults.

Every rank (and every worker process) the grader starts runs under these limits.
They are per process, and each can be changed on the command line of every
command that grades (``ddp-grade grade``, ``ddp-grade batch``):

====================  ==================  =========================================================
option                default             how it is enforced
====================  ==================  =========================================================
``--memory-limit``    2048 (MiB)          the grader reads each rank's resident memory (VmRSS in
                                          ``/proc/<pid>/status``) every 0.2 s and stops a rank that
                                          goes over it; as a backstop against a burst between two
                                          readings, the rank's address space (``RLIMIT_AS``) is
                                          capped at the limit plus 4 GiB (importing torch alone
                                          reserves about 1 GiB of address space it never touches;
                                          not with a CUDA or ROCm build of torch, whose driver
                                          reserves far more)
``--cpu-limit``       300 (seconds)       ``RLIMIT_CPU``: the kernel stops a process past that much
                                          CPU time (``SIGXCPU``); the wall-clock ``--timeout``
                                          usually ends a run first
``--output-limit``    64 (MiB)            ``RLIMIT_FSIZE``: no file a rank writes (its printed
                                          output, a checkpoint) can grow past it; writing further
                                          fails with ``OSError: File too large``
``--tmp-limit``       512 (MiB)           in a sandbox only (``--sandbox``, ``batch``): the size of
                                          the sandbox's own ``/tmp``, of its ``/dev/shm`` and of the
                                          ranks' folder, each a tmpfs (unlinked files and folders of
                                          any depth count); writing further fails with ``OSError: No space
                                          left on device``. Without a sandbox a rank writes to the
                                          machine's folders, and this limit does not apply
====================  ==================  =========================================================

``0`` turns a limit off (``--tmp-limit 0`` means its default: a sandbox's folders always have a size). A rank that hits a limit fails the run (exit 1) with a
message that names the limit and the option that changes it, for example
``rank 1 went over the memory limit (2048 MiB resident) and was stopped``.

Only what is shown of a rank's output is bounded separately: the report keeps
the last 3000 characters of each rank's output, whatever the limits.
"""

from __future__ import annotations

MIB = 2**20

DEFAULT_MEMORY_MIB = 2048
DEFAULT_CPU_SECONDS = 300
DEFAULT_OUTPUT_MIB = 64
DEFAULT_TMP_MIB = 512

# Address space on top of the resident-memory limit (RLIMIT_AS backstop): torch maps about
# 1 GiB it never touches, and gloo and the thread pools reserve stacks.
ADDRESS_SPACE_HEADROOM_BYTES = 4 * 2**30

# How often the grader reads the ranks' resident memory.
MEMORY_POLL_S = 0.2

OPTIONS = {
    "memory": "--memory-limit",
    "cpu": "--cpu-limit",
    "output": "--output-limit",
    "tmp": "--tmp-limit",
}


def limits_dict(memory_mib: float | None = DEFAULT_MEMORY_MIB, cpu_seconds: float | None = DEFAULT_CPU_SECONDS,
                output_mib: float | None = DEFAULT_OUTPUT_MIB, tmp_mib: float | None = DEFAULT_TMP_MIB) -> dict:
    """The ``limits`` a :class:`grader.rank.harness.Session` takes, from the CLI's units (0 or None: off;
    for ``tmp``, the default)."""
    return {
        "memory_bytes": int((memory_mib or 0) * MIB),
        "cpu_seconds": int(cpu_seconds or 0),
        "output_bytes": int((output_mib or 0) * MIB),
        "tmp_bytes": int((tmp_mib or DEFAULT_TMP_MIB) * MIB),
    }


DEFAULT_LIMITS = limits_dict()


SANDBOX_ENV = "DDP_GRADE_SANDBOXED"  # set by the sandbox for what runs inside it (the size of its /tmp)


def in_sandbox() -> bool:
    """True in a grading that runs inside the grader's sandbox (see :mod:`grader.sandbox`)."""
    import os

    return bool(os.environ.get(SANDBOX_ENV))


def address_space_bytes(memory_bytes: int) -> int:
    """The RLIMIT_AS backstop for a resident-memory limit (0: none)."""
    return memory_bytes + ADDRESS_SPACE_HEADROOM_BYTES if memory_bytes else 0


# In a sandbox, every process the submission starts counts: all of them together may hold this many
# times the memory limit, or the number of ranks plus this many, whichever is more.
SANDBOX_MEMORY_MIN_SHARES = 6
SANDBOX_MEMORY_EXTRA_SHARES = 3
SANDBOX_MEMORY_WORDS = "all the sandbox's processes together: the memory limit times the ranks plus 3, at least 6"


def sandbox_memory_bytes(limits: dict, ranks: int) -> int:
    """What all the processes of a sandbox may hold together (proportional set sizes), 0 when the memory
    limit is off: the limit times max(ranks + 3, 6), for the ranks, the pool and what they start."""
    memory = limits.get("memory_bytes") or 0
    return memory * max(ranks + SANDBOX_MEMORY_EXTRA_SHARES, SANDBOX_MEMORY_MIN_SHARES)


def describe(limit: str, limits: dict) -> str:
    """"the memory limit (2048 MiB resident; --memory-limit changes it)"."""
    if limit == "memory":
        amount = f"{limits.get('memory_bytes', 0) / MIB:g} MiB resident"
    elif limit == "cpu":
        amount = f"{limits.get('cpu_seconds', 0):g} s of CPU time"
    elif limit == "tmp":
        amount = f"{limits.get('tmp_bytes', 0) / MIB:g} MiB each"
        return f"the sandbox's /tmp, /dev/shm and ranks' folder limit ({amount}; {OPTIONS[limit]} changes it)"
    else:
        amount = f"{limits.get('output_bytes', 0) / MIB:g} MiB per file"
    return f"the {limit} limit ({amount}; {OPTIONS[limit]} changes it)"
