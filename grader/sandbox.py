"""Grade untrusted code in Linux namespaces: no network but loopback, no home folder, nothing outlives it.

``ddp-grade grade --sandbox FILE`` runs the whole grading (the grader, its pool, every rank) as
a child command inside a sandbox and reads its JSON report back; the command outside records
progress and renders the report as usual. Inside:

* a network namespace of its own, with only the loopback interface: the ranks still meet on
  127.0.0.1 (the grader's store is inside too), and nothing can reach another address;
* a PID namespace: when the grading ends, the kernel ends every process started in it,
  double-forked daemons included;
* the file system read-only, a fresh empty ``/tmp`` (the runs' folders), the user's home folder
  hidden behind an empty one; the learner's file, the kit and the Python that runs it are
  bound back in, read-only.

Two tools can build it: ``bwrap`` (the bubblewrap package), preferred, or ``unshare`` from
util-linux with unprivileged user namespaces. With ``unshare`` the same is built by a few lines
of Python run first inside the namespaces (loopback up, mounts); a mount it cannot make
read-only stays as it was (``doctor`` says which tool is used).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

BWRAP, UNSHARE = "bwrap", "unshare"


TOOL_ENV = "DDP_GRADE_SANDBOX_TOOL"  # "bwrap" or "unshare": use only that one


def tool() -> str | None:
    """The sandbox tool that works on this machine (tried once), or None."""
    return _tool(os.environ.get(TOOL_ENV, ""))


@functools.lru_cache(maxsize=4)
def _tool(wanted: str) -> str | None:
    for name in ([wanted] if wanted else [BWRAP, UNSHARE]):
        if shutil.which(name) and _works(name):
            return name
    return None


def _works(name: str) -> bool:
    try:
        probe = wrap([sys.executable, "-c", "import socket; print(socket.if_nameindex())"], [], name)
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "'lo'" in done.stdout


def visible_paths(extra: list[str]) -> list[str]:
    """What the grading needs to see inside: Python, the installed packages, the kit, the learner's files."""
    import grader

    paths = {sys.prefix, sys.base_prefix, str(Path(grader.__file__).resolve().parent.parent)}
    paths.update(os.path.abspath(p) for p in extra)
    for entry in sys.path[1:]:  # site-packages, editable installs' folders (not the current folder)
        if entry and os.path.isdir(entry):
            paths.add(os.path.abspath(entry))
    hidden = ("/", "/tmp", str(Path.home()))  # bound back whole, they would undo the sandbox
    return sorted(p for p in paths if os.path.exists(p) and p not in hidden)


def wrap(argv: list[str], extra_paths: list[str], name: str | None = None) -> list[str]:
    """``argv`` as run inside the sandbox built by ``name`` (default: :func:`tool`)."""
    name = name or tool()
    home = str(Path.home())
    binds = visible_paths(extra_paths)
    if name == BWRAP:
        cmd = [BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
               "--tmpfs", home, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--die-with-parent",
               "--new-session", "--chdir", "/tmp", "--setenv", "HOME", home]
        for path in binds:
            cmd += ["--ro-bind", path, path]
        return cmd + ["--", *argv]
    if name == UNSHARE:
        boot = [sys.executable, "-c", _UNSHARE_BOOT, home, *binds, "--", *argv]
        return [UNSHARE, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
                "--mount-proc", "--", *boot]
    raise RuntimeError("no sandbox tool: install bubblewrap (bwrap)")


# Runs first inside `unshare`: loopback up, the home folder and /tmp hidden behind empty ones, what the grading needs
# bound back read-only (through descriptors opened before the hiding), the rest read-only, then the grading itself.
_UNSHARE_BOOT = r"""
import ctypes, fcntl, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
def mount(src, dst, fstype, flags):
    if libc.mount(src.encode() if src else None, dst.encode(), fstype.encode() if fstype else None, flags, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount {dst}")
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ifr = struct.pack("16sH14s", b"lo", 0, b"")
flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, ifr))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))
mount("none", "/", None, MS_REC | MS_PRIVATE)
home, rest = sys.argv[1], sys.argv[2:]
split = rest.index("--")
binds, argv = rest[:split], rest[split + 1:]
hidden = [h for h in (home, "/tmp") if os.path.isdir(h)]
def under(path, root):
    return path == root or path.startswith(root.rstrip("/") + "/")
wanted = [path for path in binds if any(under(path, h) for h in hidden)]
# A path inside another one bound back (the learner's file inside a kit kept under /tmp) is seen
# through that one: binding it again would need a mount point made inside a read-only folder.
wanted = [path for path in wanted if not any(other != path and under(path, other) for other in wanted)]
keep = {path: os.open(path, os.O_PATH) for path in wanted}
for h in hidden:
    mount("tmpfs", h, "tmpfs", 0)
for path, fd in keep.items():
    source = f"/proc/self/fd/{fd}"
    if os.path.isdir(source):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    mount(source, path, None, MS_BIND | MS_REC)
    # Read-only, keeping the flags the kernel locks in a user namespace (nosuid, nodev, noexec, atime).
    st = os.statvfs(path).f_flag
    kept = (st & (2 | 4 | 8 | 1024 | 2048)) | ((1 << 21) if st & 4096 else 0)
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
    os.close(fd)
with open("/proc/self/mountinfo") as f:
    points = [line.split()[4] for line in f]
writable = ("/tmp", "/proc", "/dev", "/sys", home)
for point in points:
    if point in keep or any(point == w or point.startswith(w.rstrip("/") + "/") for w in writable):
        continue
    libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)  # best effort
os.chdir("/")
os.execv(argv[0], argv)
"""
