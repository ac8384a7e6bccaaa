"""Tries every way a rank might speak as the sandbox's host (``python -m grader...rank_host``, the one
process of the grader inside, whose pipes carry the grader's requests in and the ranks' outcomes out),
and writes a well-formed answer of the host's through each way that opens.

The ways, against the host, its pool (the forkserver, whose pipes tell the host each rank's exit status)
and the sandbox's first process (PID 1: the host itself, or bwrap's init where bwrap has one, which
holds the descriptors the sandbox was started with): each descriptor through
/proc/PID/fd; its memory through /proc/PID/mem and process_vm_readv; ptrace; pidfd_getfd; and every
descriptor this rank holds that it was not given as a rank. The host is stopped (SIGSTOP) while they are
tried, so that a forged answer would come before its own, and let go (SIGCONT) after.

The forged answer is the host's ``failed`` answer, whose words the grader shows: FORGED_BY_A_RANK in a
report means a rank spoke as the host. Each rank then raises with what it reached ("reached nothing"
when every way was closed), so the grading fails on the rank's own words."""
# expect-status: failed
# expect-absent: FORGED_BY_A_RANK

import ctypes
import errno
import os
import signal
import struct
import sys

import torch.distributed as dist

MARK = "FORGED_BY_A_RANK"
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE, PTRACE_DETACH = 0x4206, 17
SYS = {"x86_64": {"pidfd_open": 434, "pidfd_getfd": 438, "process_vm_readv": 310},
       "aarch64": {"pidfd_open": 434, "pidfd_getfd": 438, "process_vm_readv": 270}}[os.uname().machine]


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def forged_frame() -> bytes:
    """The host's ``failed`` answer, framed and encoded as the host does (with the grader's own code, which
    every rank can import), or as a pickle behind an 8-byte length where that code is not found."""
    payload = {"type": "failed", "why": MARK}
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.startswith("grader") and name.endswith("wire") and callable(getattr(module, "dumps", None)):
            try:
                data = module.dumps(payload)
                break
            except Exception:
                continue
    else:
        import pickle

        data = pickle.dumps(payload)
    return struct.pack("!Q", len(data)) + data


def command(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def targets() -> dict[int, str]:
    """{pid: what}: the host (a Python whose module is the rank host), its pool (the forkserver, which tells
    the host each rank's pid and exit status), and PID 1 in any case."""
    found = {1: "PID 1"}
    pythons = {}
    for entry in os.listdir("/proc"):
        argv = command(int(entry)).split(b"\0") if entry.isdigit() and int(entry) != os.getpid() else [b""]
        if b"python" in os.path.basename(argv[0]):
            pythons[int(entry)] = argv
    for pid, argv in pythons.items():
        if any(arg.endswith(b"rank_host") for arg in argv):
            found[pid] = "the host"
    for pid, argv in pythons.items():  # the pool's own forks (the ranks) have its command too, not its parent
        if any(b"multiprocessing.forkserver" in arg for arg in argv) and found.get(parent(pid)) == "the host":
            found[pid] = "the host's pool"
    return found


def parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def through_proc_fd(pid: int, frame: bytes) -> list[str]:
    reached = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")  # the numbers alone (where the folder's owner may list it) say nothing
    except OSError:
        return []
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            what = os.readlink(path)
        except OSError:
            continue
        reached.append(f"{path} -> {what}")
        try:
            out = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(out, frame)
            reached.append(f"wrote the forged answer into {path} -> {what}")
        except OSError:
            pass
        finally:
            os.close(out)
    return reached


def through_memory(pid: int) -> list[str]:
    reached = []
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
        os.close(fd)
        reached.append(f"/proc/{pid}/mem")
    except OSError:
        pass
    local, remote = (IoVec(ctypes.cast(ctypes.create_string_buffer(8), ctypes.c_void_p), 8), IoVec(0x10000, 8))
    if libc.syscall(SYS["process_vm_readv"], pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) >= 0 or \
            ctypes.get_errno() != errno.EPERM:  # EFAULT: allowed, only the address was wrong
        reached.append(f"process_vm_readv of {pid}")
    return reached


def through_ptrace(pid: int) -> list[str]:
    if libc.ptrace(PTRACE_SEIZE, pid, 0, 0) == 0:
        return [f"ptrace of {pid}"]
    return []


def through_pidfd(pid: int, frame: bytes) -> list[str]:
    pidfd = libc.syscall(SYS["pidfd_open"], pid, 0)
    if pidfd < 0:
        return []
    reached = []
    try:
        for number in range(256):
            got = libc.syscall(SYS["pidfd_getfd"], pidfd, number, 0)
            if got >= 0:
                reached.append(f"pidfd_getfd of {pid}'s descriptor {number}")
                try:
                    os.write(got, frame)
                except OSError:
                    pass
                os.close(got)
            elif ctypes.get_errno() == errno.EPERM:
                break  # the kernel's answer for every descriptor of a process out of reach
    finally:
        os.close(pidfd)
    return reached


def through_inherited(frame: bytes) -> list[str]:
    """Every pipe or socket this rank holds beyond its standard descriptors, its own line to the grader (a
    rank's channel: whatever it forges there is its own claim) and the pool's pipes every fork of the pool
    holds (the forkserver's alive pipe and the resource tracker's: breaking them ends only this grading)."""
    from multiprocessing import forkserver, resource_tracker
    from multiprocessing.connection import Connection

    own = {getattr(forkserver._forkserver, "_forkserver_alive_fd", None),
           getattr(resource_tracker._resource_tracker, "_fd", None)}
    for name, module in list(sys.modules.items()):
        conn = getattr(module, "_CONN", None) if name.startswith("grader") else None
        if isinstance(conn, Connection):
            own.add(conn.fileno())
    reached = []
    for fd in os.listdir("/proc/self/fd"):
        number = int(fd)
        if number <= 2 or number in own:
            continue
        try:
            what = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if what.startswith(("pipe:", "socket:")):
            try:
                os.write(number, frame)
                reached.append(f"its own descriptor {number} -> {what}")
            except OSError:
                pass
    return reached


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    frame = forged_frame()
    found = targets()
    hosts = [pid for pid, name in found.items() if name == "the host"]
    stopped = []
    for pid in hosts:
        try:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        except OSError:
            pass
    reached = []
    try:
        for pid, name in sorted(found.items()):
            got = through_proc_fd(pid, frame) + through_memory(pid) + through_ptrace(pid) + through_pidfd(pid, frame)
            reached += [f"{name}: {what}" for what in got]
        reached += through_inherited(frame)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    host_reached = [what for what in reached if what.startswith("the host") or "own descriptor" in what]
    raise RuntimeError(f"host {hosts or 'not found'}: "
                       + ("reached nothing" if not host_reached else "reached " + "; ".join(host_reached))
                       + f" (also {'; '.join(r for r in reached if r not in host_reached) or 'nothing else'})")


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
