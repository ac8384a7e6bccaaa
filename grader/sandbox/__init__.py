"""Grade untrusted code in Linux namespaces: a root of its own, no network but loopback, nothing outlives it.

``ddp-grade grade --sandbox FILE`` runs the whole grading (the grader, its pool, every rank) as
a child command inside a sandbox and reads its JSON report back; the command outside records
progress and renders the report as usual. ``ddp-grade batch`` (and Gradescope through it) gives
each submission a sandbox of its own the same way. Inside (``docs/guarantees.md`` says it in full):

* **a root file system built for the grading**, not the machine's: ``/usr`` and the links to it,
  a short list of files from ``/etc`` (the loader's cache, hosts, passwd, group, ...), the
  Python that runs the grader, its installed packages, the kit and the learner's file, all
  read-only; nothing else of the machine exists inside (no ``/home``, ``/root``, ``/var``,
  ``/run``, ``/srv``, ``/mnt``, no state folder and so no grading server's socket, wherever
  they are);
* ``/tmp``, ``/dev/shm`` and the ranks' folder (which the grader reads from outside) private tmpfs
  folders of at most ``--tmp-limit`` MiB each (:data:`DEFAULT_TMP_MIB`) and :data:`TMP_FILES` or
  :data:`RANKS_FILES` files (both held by the kernel under either tool: bwrap has no option for the
  number, so the sandbox's first step remounts each with it), gone with the sandbox; the home folder
  an empty, small one; ``/dev`` read-only;
* a system-call filter (:func:`filter_program`): no memfd, no System V shared memory or message
  queue (memory no process's resident set shows), no call of another architecture;
* a network namespace with only the loopback interface, and its own IPC and host name: the
  ranks still meet on 127.0.0.1 (the grader's store is inside too), nothing reaches another
  address, and abstract Unix sockets outside are out of reach;
* a PID namespace whose first process is the grader's one process inside (:mod:`grader.rank.rank_host`, out of
  the ranks' reach): when it ends, the kernel ends every process started in the namespace,
  double-forked daemons included, and it ends when the grading does, or when the grader's end of its
  pipe closes (the grader was killed);
* no capabilities: the grading runs with none, so it cannot mount, unmount or remount
  anything to look past the folders above;
* the environment from an allowlist (:func:`environment`): the grader's own variables and
  secrets never pass in.

Two tools can build it: ``bwrap`` (the bubblewrap package, 0.8 or newer: ``--size``),
preferred, or ``unshare`` from util-linux with unprivileged user namespaces, where a few lines
of Python run first inside the namespaces build the same root and drop every capability
(``doctor`` says which tool is used).

This package is the whole sandbox: here the tool and the command line that builds one;
:mod:`.confined` the grader's side, outside, where everything is decided; :mod:`grader.rank.rank_host` the one
process of the grader inside; :mod:`.boundary` what crosses between them and how it is checked.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

from grader.rank import limits as _limits
from grader.rank import untrusted as _untrusted

BWRAP, UNSHARE = "bwrap", "unshare"

TOOL_ENV = "DDP_GRADE_SANDBOX_TOOL"  # "bwrap" or "unshare": use only that one
PASS_ENV = "DDP_GRADE_SANDBOX_PASS"  # names of further variables to hand in, separated by commas or spaces
INSIDE_ENV = _limits.SANDBOX_ENV  # set inside: the size of /tmp in bytes (for the report of a full /tmp)

DEFAULT_TMP_MIB = _limits.DEFAULT_TMP_MIB
HOME_BYTES = 16 * 2**20
HIDDEN_BYTES = 64 * 2**10  # each empty folder that hides the state folder
HIDDEN_FILES = 64  # files and folders in each of those, and in /dev under unshare (bwrap's /dev is read-only)
TMP_FILES = 65_536  # files and folders in /tmp, in /dev/shm and in the home folder, each
RANKS_FILES = _untrusted.MAX_LISTED  # files and folders in the ranks' folder (what the grader lists at most)
RANKS_FOLDER = "/tmp/ddp-grade-ranks"  # inside: the ranks' folders (this, a dash and a name of its own), each a tmpfs

# From /etc, only what Python, torch, gloo and the C library read; nothing else of the machine's.
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "hosts", "host.conf", "nsswitch.conf", "gai.conf",
             "passwd", "group", "localtime", "alternatives", "os-release")
# The machine's system folders, bound whole (read-only) where they are folders and made again where
# they are links (a merged /usr: /bin -> usr/bin).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Devices bound from the machine's /dev into the sandbox's own small one.
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")

# The environment a submission sees: these names, these prefixes, and what PASS_ENV lists.
ENV_NAMES = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "NO_COLOR", "COLUMNS", "LINES", "PYTHONPATH",
             "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "PYTHONUTF8",
             "VIRTUAL_ENV", "RES_OPTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
ENV_PREFIXES = ("LC_", "NCCL_", "GLOO_", "CUDA_", "TORCH_DISTRIBUTED_")
# The grader's own settings that a grading inside needs (never its state folder).
GRADER_ENV = ("DDP_GRADE_SERVER", "DDP_GRADE_BATCH", "DDP_GRADE_WORKER_DYNAMO", "DDP_GRADE_SANDBOX_TOOL")


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
    """The tool builds the whole sandbox here: loopback only, the sized /tmp, the system-call filter."""
    check = "import os, socket; print(socket.if_nameindex())\ntry:\n    os.memfd_create('x')\nexcept OSError:\n    " \
            "print('filtered')"
    fd = filter_descriptor()
    try:
        probe = wrap([sys.executable, "-c", check], [], name, tmp_bytes=HOME_BYTES, filter_fd=fd)
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, env=environment({}, HOME_BYTES),
                              pass_fds=(fd,))
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        os.close(fd)
    filtered = "filtered" in done.stdout or not filter_program()
    return done.returncode == 0 and "'lo'" in done.stdout and filtered


HOST_MODULE = "grader.rank.rank_host"


def host_command(requests_fd: int, answers_fd: int) -> list[str]:
    """The command of the sandbox's host (:mod:`grader.rank.rank_host`), which reads requests on ``requests_fd`` and
    answers on ``answers_fd``: ``-s`` (no user site: the home folder inside is the ranks' to write) and,
    where Python has it, ``-P`` (no current folder on the import path: ``/tmp`` is theirs too), which
    the pool it starts inherits."""
    flags = ["-s"] + (["-P"] if sys.version_info >= (3, 11) else [])
    return [sys.executable, *flags, "-m", HOST_MODULE, str(requests_fd), str(answers_fd)]


def visible_paths(extra: list[str]) -> list[str]:
    """What the grading needs to see inside: Python, its installed packages and ``extra`` (a submission's own
    folder). Of the kit nothing here: never its folders (its solutions, its tests, its git history,
    submissions kept beside it), and of the grader's package only the rank side (:func:`rank_side_paths`).

    The environment that runs the grader (``sys.prefix``) is bound where it is, also when it lives in
    the kit's folder (the README's ``.venv``): a virtual environment cannot be moved (its scripts and
    ``pyvenv.cfg`` name their paths), and it holds only installed packages; of the kit, an editable
    install puts there a pointer to the kit's path, never a file of the kit. Each folder on the way
    to what is bound shows only the next name on that way (``tests/test_sandbox.py``)."""
    package = os.path.realpath(_package_folder())
    kit = os.path.dirname(package)
    paths = {sys.prefix, sys.base_prefix}
    paths.update(os.path.abspath(p) for p in extra)
    for entry in sys.path[1:]:  # site-packages, editable installs' folders (not the current folder)
        if not entry or not os.path.isdir(entry):
            continue
        entry = os.path.abspath(entry)
        real = os.path.realpath(entry)
        # The kit's own folder (or one above it) would show the whole kit; a folder inside the kit
        # that is not an environment's (the tests' folder, under pytest) would show what it holds.
        if _under(kit, real) or (_under(real, kit) and not _under(real, os.path.realpath(sys.prefix))):
            continue
        paths.add(entry)
    paths |= {os.path.realpath(p) for p in paths}  # a venv's python links to the base Python's
    hidden = ("/", "/tmp", str(Path.home()))  # bound back whole, they would undo the sandbox
    kept = sorted(p for p in paths if os.path.exists(p) and p not in hidden)
    # A path inside another one bound back is seen through that one.
    return [p for p in kept if not any(o != p and _under(p, o) for o in kept)]


def _package_folder() -> str:
    import grader

    return os.path.dirname(os.path.abspath(grader.__file__))


def rank_side_paths() -> tuple[str, list[str]]:
    """(the grader's package folder, what of it a sandbox shows): ``grader/__init__.py`` and the rank side,
    ``grader/rank/``, alone. Inside, the package folder is an empty, read-only folder (even where an
    installed kit lies in a folder bound whole, such as site-packages) with these two bound back into it:
    the references, verdicts and cost models of the grader's side are nowhere in a sandbox."""
    package = os.path.realpath(_package_folder())
    return package, [os.path.join(package, "__init__.py"), os.path.join(package, "rank")]


def hidden_paths() -> list[str]:
    """Folders hidden behind an empty one even when a bound folder holds them: the state folder
    (progress, the grading server's socket and key). A state folder that cannot be resolved (a
    link that loops) is hidden as it is named."""
    from grader.state import state_dir

    try:
        folder = str(state_dir())
    except (OSError, RuntimeError):
        return []
    try:
        return [os.path.realpath(folder)]
    except (OSError, RuntimeError, ValueError):
        return [os.path.abspath(folder)]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def environment(extra: dict, tmp_size: int) -> dict:
    """The environment of a sandboxed grading: the allowlist of :data:`ENV_NAMES`, :data:`ENV_PREFIXES`,
    the grader settings it needs, what ``$DDP_GRADE_SANDBOX_PASS`` names, and ``extra``."""
    passed = set(os.environ.get(PASS_ENV, "").replace(",", " ").split())
    env = {k: v for k, v in os.environ.items()
           if k in ENV_NAMES or k.startswith(ENV_PREFIXES) or k in GRADER_ENV or k in passed}
    env.update(extra)
    env.update({"HOME": str(Path.home()), "TMPDIR": "/tmp", INSIDE_ENV: str(tmp_size)})
    return env


def wrap(argv: list[str], extra_paths: list[str], name: str | None = None, tmp_bytes: int = 0,
         ranks_folder: str = "", filter_fd: int | None = None) -> list[str]:
    """``argv`` as run inside the sandbox built by ``name`` (default: :func:`tool`).

    ``extra_paths`` are bound read-only, each at its own path; ``ranks_folder`` (a path inside) is a
    tmpfs of ``tmp_bytes`` and :data:`RANKS_FILES` files, the folder the grader gives the ranks and
    reads from outside through the sandbox's first process (``/proc/PID/root``). bwrap reads the
    system-call filter (:func:`filter_program`) from ``filter_fd``, which the caller passes to it
    (:func:`filter_descriptor`); under unshare the first step inside installs it. Run it with
    ``env=environment(...)``: the tools pass the environment in as they get it.
    """
    name = name or tool()
    size = tmp_bytes or DEFAULT_TMP_MIB * 2**20
    home = str(Path.home())
    system = [p for p in SYSTEM if os.path.isdir(p) and not os.path.islink(p)]
    binds = [p for p in visible_paths(extra_paths) if not any(_under(p, s) for s in system)]
    package, rank_side = rank_side_paths()
    hide = [h for h in hidden_paths() if any(_under(h, b) for b in binds)]
    gpus = sorted(glob.glob("/dev/nvidia*")) + sorted(glob.glob("/dev/dri"))
    if name == BWRAP:
        if filter_fd is None:
            raise ValueError("bwrap needs the descriptor of the system-call filter (filter_descriptor())")
        # --as-pid-1: the command is the PID namespace's first process, as under unshare; bwrap's own init
        # would be a dumpable process of the sandbox that any rank could trace or write into.
        cmd = [BWRAP, "--unshare-user", "--disable-userns", "--unshare-net", "--unshare-pid", "--unshare-ipc",
               "--unshare-uts", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
               "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP", "--seccomp", str(filter_fd)]
        # The first step mounts these over bwrap's own, each with its number of files (in this order).
        tmpfs = {"/tmp": f"mode=1777,size={size},nr_inodes={TMP_FILES}",
                 "/dev/shm": f"mode=1777,size={size},nr_inodes={TMP_FILES}",
                 home: f"mode=700,size={HOME_BYTES},nr_inodes={TMP_FILES}"}
        for path in SYSTEM:
            if os.path.islink(path):
                cmd += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                cmd += ["--ro-bind", path, path]
        for entry in ETC_FILES:
            if os.path.exists(f"/etc/{entry}"):
                cmd += ["--ro-bind", f"/etc/{entry}", f"/etc/{entry}"]
        cmd += ["--dev", "/dev", "--proc", "/proc", "--size", str(size), "--tmpfs", "/tmp",
                "--size", str(size), "--tmpfs", "/dev/shm", "--size", str(HOME_BYTES), "--tmpfs", home]
        if ranks_folder:
            tmpfs[ranks_folder] = f"mode=700,size={size},nr_inodes={RANKS_FILES}"
        for device in gpus:
            cmd += ["--dev-bind", device, device]
        cmd += ["--remount-ro", "/dev"]  # bwrap's /dev is a tmpfs of no size: nothing is written there
        if gpus:
            cmd += ["--ro-bind", "/sys", "/sys"]
        for path in binds:
            cmd += ["--ro-bind", path, path]
        cmd += ["--size", str(HOME_BYTES), "--tmpfs", package]
        for path in rank_side:
            cmd += ["--ro-bind", path, path]
        cmd += ["--remount-ro", package]
        # the rank side goes in the boot's binds too: under a tmpfs it mounts (a kit in the home folder or
        # /tmp) it is bound back from what bwrap bound
        boot = [sys.executable, "-S", "-c", _BWRAP_BOOT, *(x for item in tmpfs.items() for x in item),
                "--binds", *binds, *rank_side, "--hide", *hide, "--package", package]
        return cmd + ["--remount-ro", "/", "--chdir", "/tmp", "--", *boot, "--", *argv]
    if name == UNSHARE:
        boot = [sys.executable, "-c", _UNSHARE_BOOT, home, str(size), ranks_folder, filter_program().hex(), *binds,
                "--hide", *hide, "--devices", *gpus, "--package", package, *rank_side, "--", *argv]
        return [UNSHARE, "--user", "--map-root-user", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                "--mount", "--mount-proc", "--", *boot]
    raise RuntimeError("no sandbox tool: install bubblewrap (bwrap)")


# System calls whose memory no process's resident set shows and no tmpfs of the sandbox holds: a memfd
# (memfd_create, memfd_secret) and System V shared memory and message queues. They fail with ENOSYS in the
# sandbox (libraries that try a memfd take another way on ENOSYS; torch's shared memory is in /dev/shm).
REFUSED_CALLS = {"x86_64": {"memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68},
                 "aarch64": {"memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186}}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32 = 0x40000000  # x86_64's x32 system calls: refused whole


def filter_program(machine: str | None = None) -> bytes:
    """The sandbox's seccomp program (classic BPF, as bwrap's ``--seccomp`` and ``PR_SET_SECCOMP`` take
    it): every call of :data:`REFUSED_CALLS`, and every call of another architecture (32-bit calls on a
    64-bit kernel, whose numbers differ), fails with ENOSYS; the rest are allowed. Empty on a machine
    it does not know (nothing is filtered there)."""
    import errno
    import struct

    machine = machine or os.uname().machine
    if machine not in REFUSED_CALLS:
        return b""
    numbers = sorted(REFUSED_CALLS[machine].values())
    load, equal, at_least, answer = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE|K, BPF_RET|K
    allow, refuse = 0x7FFF0000, 0x00050000 | errno.ENOSYS  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO
    code = [(load, 0, 0, 4), (equal, 1, 0, _AUDIT_ARCH[machine]), (answer, 0, 0, refuse), (load, 0, 0, 0)]
    if machine == "x86_64":
        code.append((at_least, len(numbers) + 1, 0, _X32))
    code += [(equal, len(numbers) - k, 0, number) for k, number in enumerate(numbers)]
    code += [(answer, 0, 0, allow), (answer, 0, 0, refuse)]
    return b"".join(struct.pack("=HBBI", *step) for step in code)


def filter_descriptor() -> int:
    """A descriptor to read :func:`filter_program` from (bwrap's ``--seccomp``): the caller passes it to
    bwrap and closes it."""
    reading, writing = os.pipe()
    try:
        os.write(writing, filter_program())
    finally:
        os.close(writing)
    return reading


# No capabilities from here on (the end of both tools' first step): nothing inside can mount, unmount or remount,
# and no program it runs, as root of the namespace or not, gets one back.
_DROP = r"""
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 28, 38, 47
for cap in range(64):
    libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
if libc.prctl(PR_SET_SECUREBITS, 0x2f, 0, 0, 0) != 0:  # noroot, no setuid fixup, keep caps off; each locked
    raise OSError(ctypes.get_errno(), "securebits")
header = (ctypes.c_uint32 * 2)(0x20080522, 0)
data = (ctypes.c_uint32 * 6)()
if libc.capset(header, data) != 0:
    raise OSError(ctypes.get_errno(), "capset")
libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
"""

# Runs first inside bwrap, which has no option for a tmpfs's number of files: with the two capabilities bwrap was
# asked to leave (in the user namespace its --disable-userns makes, which does not own bwrap's mounts: CAP_SYS_ADMIN
# to mount in a mount namespace of its own, CAP_SETPCAP to empty the bounding set), a tmpfs with the given options
# (size and number of files, nr_inodes) over each path given, in order; what bwrap bound below one of them bound
# again, read-only, and the folders that hide the state folder over it; every capability dropped; then the grading.
_BWRAP_BOOT = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, CLONE_NEWNS = 1, 2, 4, 32, 4096, 16384, 0x20000
def mount(src, dst, fstype, flags, data=None):
    if libc.mount(src.encode() if src else None, dst.encode(), fstype.encode() if fstype else None, flags,
                  data.encode() if data else None) != 0:
        raise OSError(ctypes.get_errno(), f"mount {dst}")
if libc.unshare(CLONE_NEWNS) != 0:
    raise OSError(ctypes.get_errno(), "unshare")
args = sys.argv[1:]
tmpfs, binds, hidden = args[:args.index("--binds")], args[args.index("--binds") + 1:args.index("--hide")], \
    args[args.index("--hide") + 1:args.index("--package")]
package = args[args.index("--package") + 1]
argv = args[args.index("--") + 1:]
over = tmpfs[::2]
keep = {p: os.open(p, os.O_PATH) for p in binds if any(p == t or p.startswith(t.rstrip("/") + "/") for t in over)}
covered = any(package == t or package.startswith(t.rstrip("/") + "/") for t in over)
for path, options in zip(tmpfs[::2], tmpfs[1::2]):
    os.makedirs(path, exist_ok=True)
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
# Under a tmpfs mounted here, the grader's package is an empty read-only folder of its own again (a tmpfs),
# placed after the folders above it and before the rank side bound back into it.
for path in sorted(list(keep) + ([package] if covered else []), key=lambda p: p.count("/")):
    if path == package and path not in keep:
        os.makedirs(path, exist_ok=True)
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=65536")
        continue
    source = f"/proc/self/fd/{keep[path]}"
    if os.path.isdir(source):
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "a").close()
    mount(source, path, None, MS_BIND | MS_REC)
    st = os.statvfs(path).f_flag  # read-only, keeping the flags the kernel locks (nosuid, nodev, noexec, atime)
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | (st & (2 | 4 | 8 | 1024 | 2048)) |
          ((1 << 21) if st & 4096 else 0))
    os.close(keep[path])
if covered:
    mount(None, package, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
for path in hidden:
    if os.path.isdir(path):
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=700,size=%(hidden_bytes)d,nr_inodes=%(hidden_files)d")
os.chdir("/tmp")
%(drop)s
os.execv(argv[0], argv)
""" % {"drop": _DROP, "hidden_bytes": HIDDEN_BYTES, "hidden_files": HIDDEN_FILES}

# Runs first inside `unshare`: loopback up; a new root built on a tmpfs (the machine's system folders and what the
# grading needs bound read-only, a small /dev, a fresh /proc, /tmp and /dev/shm of the given size, an empty home);
# pivot into it and let go of the old one; drop every capability; then the grading itself.
_UNSHARE_BOOT = r"""
import ctypes, fcntl, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
def mount(src, dst, fstype, flags, data=None):
    if libc.mount(src.encode() if src else None, dst.encode(), fstype.encode() if fstype else None, flags,
                  data.encode() if data else None) != 0:
        raise OSError(ctypes.get_errno(), f"mount {dst}")
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ifr = struct.pack("16sH14s", b"lo", 0, b"")
flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, ifr))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))
s.close()
mount("none", "/", None, MS_REC | MS_PRIVATE)
home, size, ranks, program, rest = sys.argv[1], int(sys.argv[2]), sys.argv[3], bytes.fromhex(sys.argv[4]), sys.argv[5:]
binds = rest[:rest.index("--hide")]
hide = rest[rest.index("--hide") + 1:rest.index("--devices")]
devices = rest[rest.index("--devices") + 1:rest.index("--package")]
package, *rank_side = rest[rest.index("--package") + 1:rest.index("--")]
argv = rest[rest.index("--") + 1:]
SYSTEM = %(system)r
ETC = %(etc)r
DEVICES = %(devices)r
sources = {}
for path in SYSTEM:
    if os.path.isdir(path) and not os.path.islink(path):
        sources[path] = path
for entry in ETC:
    if os.path.exists("/etc/" + entry):
        sources["/etc/" + entry] = "/etc/" + entry
for name in DEVICES:
    if os.path.exists("/dev/" + name):
        sources["/dev/" + name] = "/dev/" + name
for path in devices + (["/sys"] if devices else []) + binds + rank_side:
    sources[path] = path
links = {path: os.readlink(path) for path in SYSTEM if os.path.islink(path)}
keep = {path: os.open(src, os.O_PATH) for path, src in sources.items()}  # before /tmp is hidden
root = "/tmp"
mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
def place(path, fd, writable=False):
    target = root + path
    source = f"/proc/self/fd/{fd}"
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(source, target, None, MS_BIND | MS_REC)
    if writable:
        return
    # Read-only, keeping the flags the kernel locks in a user namespace (nosuid, nodev, noexec, atime).
    st = os.statvfs(target).f_flag
    kept = (st & (2 | 4 | 8 | 1024 | 2048)) | ((1 << 21) if st & 4096 else 0)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
for path, target in links.items():
    os.symlink(target, root + path)
os.makedirs(root + "/dev", exist_ok=True)
mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=65536,nr_inodes=%(hidden_files)d")
for path, options in (("/dev/shm", "mode=1777,size=%%d,nr_inodes=%(tmp_files)d" %% size),
                      ("/tmp", "mode=1777,size=%%d,nr_inodes=%(tmp_files)d" %% size),
                      (home, "mode=700,size=%(home_bytes)d,nr_inodes=%(tmp_files)d"),
                      (ranks, "mode=700,size=%%d,nr_inodes=%(ranks_files)d" %% size)):
    if path:
        os.makedirs(root + path, exist_ok=True)
        mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, options)
# The grader's package: an empty folder of its own (a tmpfs, over whatever bound folder holds it), into
# which only its rank side is bound, placed after the folders above it and before what goes inside it.
for path in sorted(list(keep) + [package], key=lambda p: p.count("/")):
    if path == package and path not in keep:
        os.makedirs(root + path, exist_ok=True)
        mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=65536")
        continue
    place(path, keep[path], writable=path.startswith("/dev/"))
    os.close(keep[path])
mount(None, root + package, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                     ("stderr", "/proc/self/fd/2")):
    os.symlink(target, root + "/dev/" + name)
for path in hide:
    if os.path.isdir(root + path):
        mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=700,size=%(hidden_bytes)d,nr_inodes=%(hidden_files)d")
os.makedirs(root + "/proc", exist_ok=True)
mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
os.chdir(root)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41}[os.uname().machine]
if libc.syscall(SYS_PIVOT_ROOT, b".", b".") != 0:
    raise OSError(ctypes.get_errno(), "pivot_root")
if libc.umount2(b".", 2) != 0:  # MNT_DETACH: the machine's root is gone from this namespace
    raise OSError(ctypes.get_errno(), "umount old root")
os.chdir("/tmp")
%(drop)sif program:  # the system-call filter (grader.sandbox.filter_program), as bwrap's --seccomp installs it
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    code = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(code, ctypes.c_void_p))
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "seccomp")
os.execv(argv[0], argv)
""" % {"system": SYSTEM, "etc": ETC_FILES, "devices": DEVICES, "home_bytes": HOME_BYTES, "hidden_bytes": HIDDEN_BYTES,
       "tmp_files": TMP_FILES, "ranks_files": RANKS_FILES, "hidden_files": HIDDEN_FILES, "drop": _DROP}
