"""The kernel's TCP counters of a network namespace, opened there: two NETLINK_SOCK_DIAG sockets, one that dumps
every TCP socket with its tcp_info, one that hears each socket destroyed (``SKNLGRP_INET_TCP_DESTROY``). The
grader reads them (:mod:`grader.traffic`) in its own namespace; inside a sandbox the host opens them first,
before any rank exists, and hands them out (:func:`send_pair`): a rank never holds them. And how a rank asks the
grader to read which sockets its process holds (:func:`ask_to_be_counted`)."""

from __future__ import annotations

import contextlib
import os
import socket

NETLINK_SOCK_DIAG = 4
GROUPS = (1 << 0) | (1 << 2)  # SKNLGRP_INET_TCP_DESTROY, SKNLGRP_INET6_TCP_DESTROY
EVENTS_BUFFER = 4 << 20  # the destroy events' receive buffer (the kernel caps it at net.core.rmem_max)
PAIR_ENV = "DDP_GRADE_SOCK_DIAG_FD"  # in the sandbox's host: the Unix socket to send the pair on
GREETING = b"sock_diag"
TRAFFIC_ENV = "DDP_GRADE_TRAFFIC"  # set in a rank whose run's traffic the grader counts: where to ask
ASK_WAIT_S = 5.0  # how long a rank waits for the grader to have counted its sockets


class Unavailable(OSError):
    """The kernel's socket counters cannot be read here (no sock_diag: not Linux, or refused)."""


def open_pair() -> tuple[socket.socket, socket.socket]:
    """(dump, events): two netlink sockets of this network namespace (Unavailable where the kernel refuses)."""
    try:
        dump = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    except (OSError, AttributeError) as exc:
        raise Unavailable(f"no sock_diag here: {exc}") from None
    try:
        events = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        with contextlib.suppress(OSError):
            events.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, EVENTS_BUFFER)
        events.bind((0, GROUPS))
    except OSError as exc:
        dump.close()
        raise Unavailable(f"the kernel does not report destroyed sockets here: {exc}") from None
    return dump, events


def send_pair() -> None:
    """In the sandbox's host, first thing: open the pair and send it over the Unix socket named by
    ``$DDP_GRADE_SOCK_DIAG_FD`` (SCM_RIGHTS), or why not; then close every descriptor of it here, so that
    nothing this process starts inherits one."""
    fd = os.environ.pop(PAIR_ENV, "")
    if not fd.isdigit():
        return
    try:
        channel = socket.socket(fileno=int(fd))
    except OSError:
        return
    with channel:
        try:
            pair = open_pair()
        except Unavailable as exc:
            with contextlib.suppress(OSError):
                channel.sendall(f"unavailable: {exc}"[:200].encode())
            return
        try:
            socket.send_fds(channel, [GREETING], [s.fileno() for s in pair])
        except OSError:
            pass
        finally:
            for s in pair:
                s.close()


def ask_to_be_counted(wait: bool = True) -> bool:
    """Where the grader counts this run's traffic (grader.traffic): ask it to read the sockets this process holds,
    and with ``wait`` wait until it has (True), or cannot (False); without, go on at once (the grader reads them
    before it answers any later ask). What it reads is the kernel's, not this process's word."""
    path = os.environ.get(TRAFFIC_ENV)
    if not path:
        return False

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(ASK_WAIT_S)
            s.connect(path)
            s.sendall(b"c")
            return s.recv(1) == b"k" if wait else True
    except OSError:
        return False
