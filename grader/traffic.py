"""What the kernel counted on the TCP connections of a run: the bytes each way on every connection between two
of its processes, read from outside the ranks (sock_diag: NETLINK_SOCK_DIAG, inet_diag's tcp_info).

A rank can rewrite anything it records about itself; it cannot make the kernel count bytes it did not send.
A :class:`Meter` watches the TCP sockets of one network namespace while a run goes, from the grader's own
process, through a :class:`Diag` opened in that namespace: the grader's own (plain gradings, whose ranks share
it), or one the sandbox's host opened inside the sandbox before any rank existed and handed out
(:func:`grader.rank.sock_diag.send_pair`, :func:`receive_pair`). No rank holds it.

What is counted, per connection and direction: ``tcpi_bytes_received`` of the receiving socket (payload bytes
the kernel took in; a FIN counts one), or where the receiving end was never seen, ``tcpi_bytes_acked`` of the
sending one less its SYN. Each socket's last figure is the one of its destroy event (``SKNLGRP_INET_TCP_DESTROY``:
the kernel reports every TCP socket of the namespace as it goes, with its tcp_info), or of the last dump where
it outlived the run.

Which rank holds a socket: a process asks to be counted (:func:`grader.rank.sock_diag.ask_to_be_counted`, over a
Unix socket in the session's folder) while its connections are open; the meter reads the kernel's sockets and
``/proc/PID/fd`` of the process that asked, whose pid the kernel gives (``SO_PEERCRED``), never the rank, and
its parents (a process a rank started counts for that rank, :meth:`Traffic.spawned`). A rank that does not ask
leaves its sockets to nobody: their bytes count for no rank (:meth:`Traffic.unowned`), so a check that needs
traffic between ranks fails. A socket that processes of two ranks hold (over ``SCM_RIGHTS``) belongs to neither.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from grader.rank.processes import namespace_pids, parents_of  # noqa: F401  (read here, and by the sandbox)
from grader.rank.sock_diag import GREETING, TRAFFIC_ENV, Unavailable, open_pair

SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
LISTEN, TIME_WAIT = 10, 6
BYTES_ACKED_AT, BYTES_RECEIVED_AT = 120, 128  # offsets in struct tcp_info (linux/tcp.h)
SETTLE_S = 2.0  # after a run, at most this long for the kernel to report the sockets its ranks closed
MAX_ASKS = 256  # requests to be counted one run answers (each costs a dump); more are not answered
MAX_PENDING = 64  # connections to the meter's socket waiting to ask, at most
ASK_SILENT_S = 2.0  # a connection that has not asked this long after it came is dropped
DUMP_WAIT_S = 5.0  # the longest the kernel may take to answer a dump
SOCKET_NAME = "traffic.sock"  # the meter's Unix socket, in the folder of the session's runs
_HEADER = struct.Struct("=IHHII")


@dataclass
class Sock:
    """One TCP socket as the kernel described it."""

    cookie: int  # the kernel's id of the socket, the same in every dump and in its destroy event
    state: int
    local: tuple[str, int]
    remote: tuple[str, int]
    inode: int  # 0 once the socket has no file (closed, or not yet accepted)
    acked: int | None  # tcpi_bytes_acked: bytes sent and acknowledged (its SYN and FIN count one each)
    received: int | None  # tcpi_bytes_received: bytes received (a FIN counts one)


def _address(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    text = socket.inet_ntop(socket.AF_INET6, raw)
    return text[7:] if text.startswith("::ffff:") and "." in text else text  # a v4-mapped address as v4


def parse(payload: bytes) -> Sock | None:
    """One inet_diag_msg (a dump's answer or a destroy event); None when it is not one."""
    if len(payload) < 72:
        return None
    family, state = payload[0], payload[1]
    sport, dport = struct.unpack_from(">HH", payload, 4)
    cookie = struct.unpack_from("=Q", payload, 44)[0]
    inode = struct.unpack_from("=I", payload, 68)[0]
    acked = received = None
    offset = 72
    while offset + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, offset)
        if length < 4:
            break
        if kind == INET_DIAG_INFO and length - 4 >= BYTES_RECEIVED_AT + 8:
            acked, received = struct.unpack_from("=QQ", payload, offset + 4 + BYTES_ACKED_AT)
        offset += (length + 3) & ~3
    try:
        local, remote = _address(family, payload[8:24]), _address(family, payload[24:40])
    except (OSError, ValueError):
        return None
    return Sock(cookie, state, (local, sport), (remote, dport), inode, acked, received)


def _messages(data: bytes):
    """(type, sequence number, payload) of each netlink message in ``data``."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _, seq, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size:
            return
        yield kind, seq, data[offset + _HEADER.size:offset + length]
        offset += (length + 3) & ~3


def receive_pair(unix: socket.socket, timeout_s: float) -> tuple[socket.socket, socket.socket]:
    """The pair :func:`grader.rank.sock_diag.send_pair` sent on ``unix`` (Unavailable when it sent why not, or
    nothing in time)."""
    unix.settimeout(timeout_s)
    try:
        message, fds, _, _ = socket.recv_fds(unix, 256, 2)
    except OSError as exc:
        raise Unavailable(f"no counters came from the sandbox: {exc}") from None
    sockets = [socket.socket(fileno=fd) for fd in fds]
    if message != GREETING or len(sockets) != 2 or any(s.family != socket.AF_NETLINK for s in sockets):
        for s in sockets:
            s.close()
        raise Unavailable(f"the sandbox sent no counters: {message[:200].decode(errors='replace')}")
    return sockets[0], sockets[1]


class Diag:
    """Dumps of one network namespace's TCP sockets, and the sockets destroyed there."""

    def __init__(self, pair: tuple[socket.socket, socket.socket] | None = None):
        self.dump_socket, self.events = pair or open_pair()
        self.events.setblocking(False)
        self.lost = False  # some destroy event was dropped (the buffer overflowed): figures may be short
        self._seq = 0
        self._lock = threading.RLock()  # one reader at a time (a process keeps one Diag of its own namespace)

    def close(self) -> None:
        self.dump_socket.close()
        self.events.close()

    def dump(self) -> list[Sock]:
        """Every TCP socket of the namespace, both families (OSError when the kernel does not answer in
        DUMP_WAIT_S)."""
        with self._lock:
            return self._dump()

    def _dump(self) -> list[Sock]:
        found = []
        self._drain()
        for family in (socket.AF_INET, socket.AF_INET6):
            self._seq += 1
            body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, 0xFFFFFFFF)
            body += b"\0" * 48
            self.dump_socket.send(_HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY,
                                               NLM_F_REQUEST | NLM_F_DUMP, self._seq, 0) + body)
            done = False
            while not done:
                data = self.dump_socket.recv(1 << 20)
                for kind, seq, payload in _messages(data):
                    if seq != self._seq:
                        continue  # left over from a dump that failed half-way
                    if kind == NLMSG_DONE:
                        done = True
                    elif kind == NLMSG_ERROR:
                        errno = -struct.unpack_from("=i", payload, 0)[0] if len(payload) >= 4 else 0
                        if errno:
                            raise OSError(errno, "sock_diag refused a dump")
                        done = True
                    elif kind == SOCK_DIAG_BY_FAMILY:
                        sock = parse(payload)
                        if sock is not None:
                            found.append(sock)
        return found

    def _drain(self) -> None:
        self.dump_socket.setblocking(False)
        try:
            while True:
                self.dump_socket.recv(1 << 20)
        except OSError:
            pass
        finally:
            self.dump_socket.settimeout(DUMP_WAIT_S)

    def destroyed(self) -> list[Sock]:
        """The sockets the kernel reported destroyed since the last call, with their last figures."""
        with self._lock:
            return self._destroyed()

    def _destroyed(self) -> list[Sock]:
        out = []
        while True:
            try:
                data = self.events.recv(1 << 20)
            except BlockingIOError:
                return out
            except OSError:  # ENOBUFS: events were dropped
                self.lost = True
                continue
            for kind, _, payload in _messages(data):
                if kind == SOCK_DIAG_BY_FAMILY:
                    sock = parse(payload)
                    if sock is not None:
                        out.append(sock)


# --- the processes -----------------------------------------------------------------------------------------


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets ``pid`` holds open (empty when its descriptors cannot be read)."""
    out = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            with contextlib.suppress(ValueError):
                out.add(int(target[8:-1]))
    return out


# --- a run's traffic ---------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """What the kernel counted during a run: each socket seen, who held it, and its last figures."""

    sockets: dict[int, Sock] = field(default_factory=dict)  # by cookie
    holders: dict[int, set[int]] = field(default_factory=dict)  # cookie -> the pids seen holding it
    ancestry: dict[int, list[int]] = field(default_factory=dict)  # pid -> its parents, nearest first
    inner: dict[int, list[int]] = field(default_factory=dict)  # pid -> NSpid (outermost first)
    asks: int = 0  # requests to be counted that were answered
    complete: bool = True  # no destroy event was dropped and every reading worked

    def rank_of(self, pid: int, ranks: dict[int, int]) -> int | None:
        """The rank whose process is ``pid`` or one of its parents (``ranks``: pid -> rank)."""
        for candidate in [pid, *self.ancestry.get(pid, [])]:
            if candidate in ranks:
                return ranks[candidate]
        return None

    def outer_pid(self, pid: int, level: int) -> int | None:
        """The pid, as this process sees it, of the process the PID namespace ``level`` deep calls ``pid``
        (among the processes that asked to be counted)."""
        if level == 0:
            return pid
        found = [p for p, chain in self.inner.items() if len(chain) > level and chain[level] == pid]
        return found[0] if len(found) == 1 else None

    def owner(self, cookie: int, ranks: dict[int, int]) -> int | None:
        """The rank holding socket ``cookie``: None when no process of a rank was seen holding it, or
        processes of two ranks were."""
        found = {self.rank_of(pid, ranks) for pid in self.holders.get(cookie, ())}
        found.discard(None)
        return found.pop() if len(found) == 1 else None

    def connections(self) -> list[tuple[Sock, Sock | None]]:
        """Each connection once: a socket and its peer's socket in this namespace (None when never seen)."""
        by_ends = {(s.local, s.remote): s for s in self.sockets.values() if s.state != LISTEN}
        seen, out = set(), []
        for s in sorted(by_ends.values(), key=lambda s: s.cookie):
            if s.cookie in seen:
                continue
            peer = by_ends.get((s.remote, s.local))
            seen.add(s.cookie)
            if peer is not None:
                seen.add(peer.cookie)
            out.append((s, peer))
        return out

    def flows(self, ranks: dict[int, int]) -> list[dict]:
        """Each direction of every connection between two ranks' processes: ``{"from": rank, "to": rank,
        "bytes": n}`` (``ranks``: pid -> rank; a connection one end of which no rank holds, such as a store's,
        is left out)."""
        out = []
        for a, b in self.connections():
            ra = self.owner(a.cookie, ranks)
            rb = self.owner(b.cookie, ranks) if b is not None else None
            if ra is None or rb is None or ra == rb:
                continue
            out.append({"from": ra, "to": rb, "bytes": _sent(a, b)})
            out.append({"from": rb, "to": ra, "bytes": _sent(b, a)})
        return out

    def between(self, ranks: dict[int, int]) -> dict[tuple[int, int], int]:
        """Bytes from rank i to rank j, summed over their connections: ``{(i, j): bytes}`` (pairs that had a
        connection only)."""
        out: dict[tuple[int, int], int] = {}
        for flow in self.flows(ranks):
            key = (flow["from"], flow["to"])
            out[key] = out.get(key, 0) + flow["bytes"]
        return out

    def spawned(self, ranks: dict[int, int]) -> dict[int, dict[int, int]]:
        """``{rank: {pid: bytes}}``: each process a rank started that asked to be counted (not the rank's own), and
        the bytes it sent the others that rank started (a socket two processes hold counts for neither)."""
        started = {pid: r for pid in self.ancestry if pid not in ranks and (r := self.rank_of(pid, ranks)) is not None}
        out: dict[int, dict[int, int]] = {}
        for pid, rank in started.items():
            out.setdefault(rank, {})[pid] = 0
        for a, b in self.connections():
            for sender, receiver in ((a, b), (b, a)) if b is not None else ():
                by, to = ({p for p in self.holders.get(s.cookie, ()) if p in started} for s in (sender, receiver))
                if len(by) == len(to) == 1 and by != to and started[min(by)] == started[min(to)]:
                    out[started[min(by)]][min(by)] += _sent(sender, receiver)
        return out

    def unowned(self, ranks: dict[int, int], known: set[int] = frozenset()) -> int:
        """Bytes a rank received on connections whose other end no rank was seen holding alone, besides those
        from the processes in ``known`` (pids whose connections are the grader's own: its store)."""
        total = 0
        for a, b in self.connections():
            for mine, other in ((a, b), (b, a)):
                if mine is None or self.owner(mine.cookie, ranks) is None:
                    continue
                if other is not None and (self.owner(other.cookie, ranks) is not None
                                          or self.holders.get(other.cookie, set()) & known):
                    continue
                total += mine.received or 0
        return total


def _sent(sender: Sock, receiver: Sock | None) -> int:
    """Bytes from ``sender``'s end to the other: what the receiver took in, or what it acknowledged."""
    if receiver is not None and receiver.received is not None:
        return receiver.received
    return max(0, (sender.acked or 0) - 1)


class Meter:
    """Count one run's traffic (a thread of this process) and return it from :meth:`stop`: the destroy events as
    they come and, each time ranks ask on the Unix socket at :attr:`path`, the sockets of the namespace and
    those the asking processes hold (several asks at once share one reading). ``known``: processes (the grader,
    the sandbox's host) whose sockets are read at every reading too, so that the store's connections have an
    owner. A rank cannot stall it: an ask is one byte read when it comes, a connection that says nothing within
    :data:`ASK_SILENT_S` is dropped, and at most :data:`MAX_ASKS` asks are answered."""

    def __init__(self, diag: Diag, folder: str, known: list[int] = (), inside: str | None = None):
        self.diag = diag
        self.known = list(known)
        self.traffic = Traffic()
        self.failed = ""  # why a reading failed, if one did (the figures may then be short)
        self.path = os.path.join(folder, SOCKET_NAME)
        self.asked_at = os.path.join(inside or folder, SOCKET_NAME)  # the same socket, as the ranks name it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o777)  # a rank under another user of the sandbox may ask too
        self.listener.listen(64)
        self.listener.setblocking(False)
        self._pending: dict[socket.socket, float] = {}  # connections that have not asked yet, and since when
        self._wake_r, self._wake_w = os.pipe()
        self._lock = threading.Lock()
        with self._lock:
            self.diag.destroyed()  # what was destroyed before the run is not the run's
        self._thread = threading.Thread(target=self._loop, name="ddp-grade traffic", daemon=True)
        self._thread.start()

    @property
    def env(self) -> dict:
        """What a rank of the run needs to ask to be counted."""
        return {TRAFFIC_ENV: self.asked_at}

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            for conn in [c for c, since in self._pending.items() if now - since > ASK_SILENT_S]:
                self._drop(conn)
            waiting = [self.listener, self.diag.events, self._wake_r, *self._pending]
            try:
                ready, _, _ = select.select(waiting, [], [], ASK_SILENT_S if self._pending else None)
            except (OSError, ValueError):
                return
            if self._wake_r in ready:
                return
            try:
                if self.listener in ready:
                    self._accept()
                asking = [c for c in ready if c in self._pending and self._asks(c)]
                if asking:
                    self._count(asking)
                if self.diag.events in ready:
                    with self._lock:
                        self._take(self.diag.destroyed(), held=None)
            except Exception as exc:  # a reading that failed leaves figures short: said, never a crash
                self.failed = f"{type(exc).__name__}: {exc}"[:200]

    def _accept(self) -> None:
        while len(self._pending) < MAX_PENDING:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError, OSError):
                return
            conn.setblocking(False)
            self._pending[conn] = time.monotonic()

    def _asks(self, conn: socket.socket) -> bool:
        """Whether ``conn`` asked to be counted (else it is dropped)."""
        try:
            asked = conn.recv(1) == b"c" and self.traffic.asks < MAX_ASKS
        except OSError:
            asked = False
        if not asked:
            self._drop(conn)
        return asked

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        conn.close()

    def _count(self, asking: list[socket.socket]) -> None:
        pids = []
        for conn in asking:
            with contextlib.suppress(OSError, struct.error):
                pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                if pid > 0:
                    pids.append(pid)
        self.sample(pids)
        self.traffic.asks += len(asking)
        for conn in asking:
            with contextlib.suppress(OSError):
                conn.send(b"k")
            self._drop(conn)

    def sample(self, pids: list[int] = ()) -> list[Sock]:
        """One reading: every socket alive now, those destroyed since, and which of them the processes
        ``pids`` (and the known ones) hold."""
        with self._lock:
            held: dict[int, set[int]] = {}
            for holder in [*pids, *self.known]:
                for inode in socket_inodes(holder):
                    held.setdefault(inode, set()).add(holder)
                if holder not in self.traffic.ancestry:
                    self.traffic.ancestry[holder] = parents_of(holder)
                    self.traffic.inner[holder] = namespace_pids(holder)
            alive = self.diag.dump()
            self._take(alive, held)
            self._take(self.diag.destroyed(), held=None)
            return alive

    def _take(self, socks: list[Sock], held: dict | None) -> None:
        traffic = self.traffic
        for s in socks:
            if s.state == TIME_WAIT or s.acked is None:
                continue
            known = traffic.sockets.get(s.cookie)
            if known is not None and known.inode and not s.inode:
                s.inode = known.inode
            traffic.sockets[s.cookie] = s
            if held and s.inode in held:
                traffic.holders.setdefault(s.cookie, set()).update(held[s.inode])

    def stop(self, settle_s: float = SETTLE_S) -> Traffic:
        """Stop answering; wait (at most ``settle_s``) until the kernel has reported the sockets of the run's
        processes that are gone, and return what was counted."""
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        for conn in list(self._pending):
            self._drop(conn)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self.listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        until = time.monotonic() + settle_s
        while True:
            try:
                alive = self.sample()
            except Exception as exc:
                self.failed = f"{type(exc).__name__}: {exc}"[:200]
                break
            open_now = {s.cookie for s in alive if s.state not in (LISTEN, TIME_WAIT)}
            waiting = [c for c, pids in self.traffic.holders.items()
                       if c in open_now and not any(os.path.exists(f"/proc/{p}") for p in pids)]
            if not waiting or time.monotonic() >= until:
                break
            time.sleep(0.005)
        self.traffic.complete = not self.failed
        return self.traffic


# --- what the checks read ------------------------------------------------------------------------------------


@dataclass
class RunTraffic:
    """One run's traffic between its ranks, as the kernel counted it: what a check reads
    (``WorldOutcome.traffic``). ``sent[(i, j)]``: payload bytes from rank i to rank j over all their connections
    (a pair without a connection is absent); ``unowned``: bytes the ranks received on connections whose other
    end no rank (nor the grader) was seen holding; ``counted``: the ranks whose processes asked to be counted."""

    world_size: int
    sent: dict[tuple[int, int], int]
    unowned: int
    counted: set[int]
    complete: bool = True
    spawned: dict[int, dict[int, int]] = field(default_factory=dict)  # rank -> {pid it started: bytes to siblings}

    def to(self, i: int, j: int) -> int:
        return self.sent.get((i, j), 0)

    def out_of(self, i: int) -> int:
        """Bytes rank i sent to the other ranks."""
        return sum(b for (a, _), b in self.sent.items() if a == i)

    def into(self, j: int) -> int:
        """Bytes rank j received from the other ranks."""
        return sum(b for (_, c), b in self.sent.items() if c == j)

    def uncounted(self) -> list[int]:
        """The ranks whose processes never asked to be counted (their sockets belong to nobody)."""
        return [r for r in range(self.world_size) if r not in self.counted]

    def table(self) -> str:
        """One line per rank: the bytes it sent each other rank."""
        lines = []
        for i in range(self.world_size):
            cells = ", ".join(f"to {j} {self.to(i, j):,}" for j in range(self.world_size) if j != i)
            lines.append(f"rank {i}: {cells}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "sent": [[i, j, b] for (i, j), b in sorted(self.sent.items())],
                "unowned": self.unowned, "counted": sorted(self.counted), "complete": self.complete}


def of_run(traffic: Traffic, outcome, level: int = 0, known: list[int] = ()) -> RunTraffic:
    """The :class:`RunTraffic` of ``outcome``'s ranks (``level``: how many PID namespaces deeper than this
    process the pids in ``outcome`` are counted: 0 for a plain grading, 1 for a sandbox's host)."""
    ranks = {}
    for r in outcome.ranks:
        pid = traffic.outer_pid(r.pid, level) if r.pid else None
        if pid is not None:
            ranks[pid] = r.rank
    counted = {rank for pid in traffic.ancestry if (rank := traffic.rank_of(pid, ranks)) is not None}
    return RunTraffic(outcome.world_size, traffic.between(ranks), traffic.unowned(ranks, set(known)), counted,
                      traffic.complete, traffic.spawned(ranks))


_LOCAL: list = []  # this process's own Diag, opened once (None where the kernel's counters cannot be read)
_LOCAL_LOCK = threading.Lock()


def local_diag() -> Diag | None:
    """A :class:`Diag` of this process's own namespace (opened once), or None where the counters cannot be
    read."""
    with _LOCAL_LOCK:
        if not _LOCAL:
            try:
                _LOCAL.append(Diag())
            except Unavailable:
                _LOCAL.append(None)
        return _LOCAL[0]


def meter_for(session) -> tuple[Meter, int, list[int]] | None:
    """A meter for the next run of ``session``, with the PID namespace level of its ranks' pids and the
    processes that hold the store; None where the kernel's counters cannot be read. A sandboxed session
    (:class:`grader.sandbox.confined.ConfinedSession`) gives its own (its ``counters()``); any other session's
    ranks share this process's namespace."""
    counters = getattr(session, "counters", None)
    if counters is not None:
        got = counters()
        if got is None:
            return None
        diag, (folder, inside), level, known = got
    else:
        diag, level, known = local_diag(), 0, [os.getpid()]
        folder = inside = session.tmp
        if diag is None:
            return None
    return Meter(diag, folder, known, inside), level, known
