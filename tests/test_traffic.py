"""What the kernel counts between processes (grader.traffic): exact payload bytes per connection and direction,
each socket given to the process that held it when it asked (the kernel names the asker), nothing to a process
that did not ask, and a meter no process can stall. Real sockets on loopback, real processes; and the same
inside a sandbox of each tool present, whose counters the sandbox's first process hands out."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import time

import pytest

from grader import traffic
from grader.rank import sock_diag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A listener and two processes (it, and a child it forks) with one connection between them: the child sends
# SEND bytes and gets REPLY back; each asks to be counted (or not, by the arguments), then both end.
PAIR = r'''
import os, socket, sys, time
sys.path.insert(0, ROOT)
from grader.rank import sock_diag
send, reply, ask_child, ask_parent = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
address = listener.getsockname()
child = os.fork()
if child == 0:
    listener.close()
    c = socket.socket(); c.connect(address); c.sendall(b"x" * send)
    if ask_child: sock_diag.ask_to_be_counted()
    got = 0
    while got < reply: got += len(c.recv(1 << 20))
    os._exit(0)
a, _ = listener.accept()
got = 0
while got < send: got += len(a.recv(1 << 20))
if ask_parent: sock_diag.ask_to_be_counted()
a.sendall(b"y" * reply)
os.waitpid(child, 0)
print(os.getpid(), child, flush=True)
'''.replace("ROOT", repr(ROOT))


def payload(counted: dict, expected: dict) -> bool:
    """Each direction holds exactly its payload, or one byte more: the FIN, when it arrived before the socket was
    destroyed (the side that closes first may be gone before the other's FIN comes)."""
    return counted.keys() == expected.keys() and all(0 <= counted[k] - v <= 1 for k, v in expected.items())


def run_pair(meter, send: int, reply: int, ask_child: bool = True, ask_parent: bool = True, argv=None, env=None):
    """Run PAIR under ``meter``; (parent pid, child pid) as PAIR printed them, and the traffic counted."""
    command = argv or [sys.executable, "-c", PAIR]
    done = subprocess.run([*command, str(send), str(reply), str(int(ask_child)), str(int(ask_parent))],
                          env={**os.environ, **meter.env, **(env or {})}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    parent, child = map(int, done.stdout.split())
    return parent, child, meter.stop()


@pytest.fixture
def diag():
    found = traffic.local_diag()
    if found is None:
        pytest.skip("the kernel's socket counters cannot be read here")
    return found


def test_the_bytes_each_way_are_the_payload_and_each_socket_goes_to_the_process_that_held_it(diag, tmp_path):
    meter = traffic.Meter(diag, str(tmp_path))
    parent, child, counted = run_pair(meter, 100_000, 12_345)
    between = counted.between({parent: 0, child: 1})
    assert payload(between, {(1, 0): 100_000, (0, 1): 12_345}), between
    assert counted.asks == 2 and counted.complete


def test_a_process_that_does_not_ask_leaves_its_sockets_to_nobody(diag, tmp_path):
    meter = traffic.Meter(diag, str(tmp_path))
    parent, child, counted = run_pair(meter, 50_000, 10, ask_child=False)
    ranks = {parent: 0, child: 1}
    assert counted.between(ranks) == {}  # one end has no owner: not a connection between two ranks
    assert 50_000 <= counted.unowned(ranks) <= 50_001  # what rank 0 received from nobody's socket


def test_a_socket_two_ranks_hold_belongs_to_neither(diag, tmp_path):
    """A rank that passes its socket to another (SCM_RIGHTS, or here a fork that keeps it) cannot have its
    bytes counted for the other."""
    meter = traffic.Meter(diag, str(tmp_path))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        pid = os.fork()
        if pid == 0:  # holds both ends too, and asks
            sock_diag.ask_to_be_counted.__globals__["os"].environ[sock_diag.TRAFFIC_ENV] = meter.path
            os._exit(0 if sock_diag.ask_to_be_counted() else 1)
        assert os.waitpid(pid, 0)[1] == 0
        client.sendall(b"z" * 1000)
        server.recv(2000)
        os.environ[sock_diag.TRAFFIC_ENV] = meter.path
        try:
            assert sock_diag.ask_to_be_counted()
        finally:
            del os.environ[sock_diag.TRAFFIC_ENV]
        client.close()
        server.close()
    counted = meter.stop()
    assert counted.between({os.getpid(): 0, pid: 1}) == {}


def test_a_connection_that_says_nothing_or_something_else_does_not_stall_the_meter(diag, tmp_path):
    meter = traffic.Meter(diag, str(tmp_path))
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(meter.path)
    noisy = socket.socket(socket.AF_UNIX)
    noisy.connect(meter.path)
    noisy.sendall(b"please count this as rank 0's")
    started = time.monotonic()
    parent, child, counted = run_pair(meter, 1000, 1000)
    assert payload(counted.between({parent: 0, child: 1}), {(1, 0): 1000, (0, 1): 1000})
    assert time.monotonic() - started < traffic.ASK_SILENT_S + 30  # answered while the silent one still waited
    silent.close()
    noisy.close()


def test_the_pair_parses_a_dump_of_its_own_socket(diag):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        inode = os.fstat(listener.fileno()).st_ino
        mine = [s for s in diag.dump() if s.local == ("127.0.0.1", listener.getsockname()[1])]
    assert len(mine) == 1 and mine[0].state == traffic.LISTEN and mine[0].inode == inode


def test_a_message_that_is_not_a_socket_is_skipped():
    assert traffic.parse(b"") is None and traffic.parse(b"\0" * 40) is None
    body = struct.pack("=BBBB", socket.AF_INET, 1, 0, 0) + struct.pack(">HH", 5, 6) + b"\x7f\0\0\x01" + b"\0" * 12 \
        + b"\x7f\0\0\x02" + b"\0" * 12 + b"\0" * 4 + struct.pack("=Q", 77) + b"\0" * 16 + struct.pack("=I", 9)
    sock = traffic.parse(body)
    assert (sock.cookie, sock.local, sock.remote, sock.inode, sock.acked) == (77, ("127.0.0.1", 5), ("127.0.0.2", 6), 9,
                                                                                None)


def _inside(tool: str, folder: str) -> list[str]:
    """PAIR's command in a fresh network and PID namespace of ``tool``, ``folder`` (the meter's) bound in; the
    namespace's first process sends its counters out first, as the sandbox's host does."""
    first = (f"import sys; sys.path.insert(0, {ROOT!r}); from grader.rank import sock_diag; sock_diag.send_pair(); "
             f"import os; os.execv(sys.executable, [sys.executable, '-c', {PAIR!r}] + sys.argv[1:])")
    if tool == "bwrap":
        return ["bwrap", "--unshare-user", "--unshare-net", "--unshare-pid", "--die-with-parent", "--ro-bind", "/", "/",
                "--proc", "/proc", "--dev", "/dev", "--bind", folder, folder, sys.executable, "-c", first]
    loopback_up = ("import fcntl, socket, struct, os, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                   "flags = struct.unpack('16sH14s', fcntl.ioctl(s, 0x8913, struct.pack('16sH14s', b'lo', 0, b'')))[1];"
                   " fcntl.ioctl(s, 0x8914, struct.pack('16sH14s', b'lo', flags | 1, b'')); "
                   "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1]] + sys.argv[2:])")
    return ["unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
            loopback_up, first]


@pytest.mark.parametrize("tool", ["bwrap", "unshare"])
def test_inside_a_sandbox_the_first_process_hands_out_its_namespaces_counters(tool, tmp_path):
    if shutil.which(tool) is None:
        pytest.skip(f"no {tool} here")
    outside, inside = socket.socketpair()
    folder = str(tmp_path)
    process = subprocess.Popen([*_inside(tool, folder), "200000", "7", "1", "1"],
                               env={**os.environ, sock_diag.PAIR_ENV: str(inside.fileno()),
                                    sock_diag.TRAFFIC_ENV: os.path.join(folder, traffic.SOCKET_NAME)},
                               pass_fds=(inside.fileno(),), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    inside.close()
    try:
        pair = traffic.receive_pair(outside, 30)
    except traffic.Unavailable:
        process.kill()
        pytest.skip(f"{tool} does not build a network namespace here: {process.communicate()[1][-300:]}")
    diag = traffic.Diag(pair)
    meter = traffic.Meter(diag, folder)
    out, err = process.communicate(timeout=60)
    counted = meter.stop()
    diag.close()
    assert process.returncode == 0, err[-2000:]
    parent, child = map(int, out.split())  # as the sandbox's PID namespace sees them
    ranks = {traffic_pid: rank for rank, inner in enumerate((parent, child))
             if (traffic_pid := counted.outer_pid(inner, 1)) is not None}
    assert payload(counted.between(ranks), {(1, 0): 200_000, (0, 1): 7}), counted.between(ranks)
    assert all(not s.local[0].startswith("10.") for s in counted.sockets.values())  # the sandbox's loopback only
