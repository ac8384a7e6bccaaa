"""A pids cgroup for one sandbox, where this process can make one: a limit the kernel holds on how many
tasks (processes and threads) the whole sandbox runs at once.

Inside the sandbox the host sets ``RLIMIT_NPROC``, which the kernel counts per user and user namespace
(Linux 5.14 and later) and which binds every user but one: it exempts root, the machine's uid 0, whatever
uid the namespace shows. So where the grader runs as root and can make a cgroup with the pids controller
(cgroup v1's pids hierarchy, or cgroup v2's root with pids enabled for its children), the tool's process
is put in one of its own, with ``pids.max``, before it starts anything: every task of the sandbox is
counted there. Elsewhere (a user: ``RLIMIT_NPROC`` binds; root in a container whose cgroups are
read-only) none is made, and the grader's own reading of the sandbox's processes every 0.5 s is what is
left for root.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid

PREFIX = "ddp-grade-"


class TaskGroup:
    """The cgroup of one sandbox (``path``), or none (``path`` None): :meth:`command` puts a command in it."""

    def __init__(self, path: str | None = None):
        self.path = path

    @classmethod
    def make(cls, tasks: int) -> "TaskGroup":
        if not tasks or os.geteuid() != 0:
            return cls()
        for base in _bases():
            _remove_stale(base)
            path = os.path.join(base, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
            try:
                os.mkdir(path, 0o755)
            except OSError:
                continue
            try:
                with open(os.path.join(path, "pids.max"), "w") as f:
                    f.write(str(tasks))
            except OSError:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
                continue
            return cls(path)
        return cls()

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run in this group: a shell moves itself in, then becomes ``argv`` (the same process)."""
        if self.path is None:
            return argv
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(self.path, "cgroup.procs"), *argv]

    def remove(self) -> None:
        """Remove the group once the sandbox has ended (its last tasks may take a moment to be gone)."""
        if self.path is None:
            return
        for _ in range(20):
            try:
                os.rmdir(self.path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)
        self.path = None


def _bases() -> list[str]:
    """The folders where a pids cgroup can be made: cgroup v1's pids hierarchy, cgroup v2's root when it
    gives its children the pids controller."""
    found = []
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return []
    for fields in mounts:
        try:
            point, kind, options = fields[4], fields[fields.index("-") + 1], fields[-1].split(",")
        except (ValueError, IndexError):
            continue
        if kind == "cgroup" and "pids" in options:
            found.append(point)
        elif kind == "cgroup2":
            try:
                with open(os.path.join(point, "cgroup.subtree_control")) as f:
                    if "pids" in f.read().split():
                        found.append(point)
            except OSError:
                continue
    return found


def _remove_stale(base: str) -> None:
    """Remove the empty groups left by graders that were killed (their pid, in the name, is gone)."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(base, name))
