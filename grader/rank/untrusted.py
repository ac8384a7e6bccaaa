"""What the grader reads from a submission, read so that nothing in it can hurt the grader.

Everything a submission produces is untrusted: the text its ranks print or put in an exception,
the files its ranks leave, the submission file itself. This module is the one place that reads
them:

* :func:`clean_text` removes every terminal control sequence (CSI, OSC, DCS and the other string
  sequences, a lone ESC, the C1 controls, and every C0 control but newline and tab) and the
  bidirectional controls (U+202A-202E, U+2066-2069), so what a rank printed is shown as text and
  never drives the terminal (OSC 52 would set the clipboard) nor reorders the line it is in;
  :func:`clean_line` also turns newlines into spaces, for one table cell or one progress line.
* :func:`read_bytes` opens a file a rank left without following a symbolic link anywhere below
  the grading's own folder, only if it is a regular file (a FIFO or a device is refused without
  blocking), and reads at most a given number of bytes; :func:`load_tensors` reads a checkpoint
  that way and loads it with :mod:`grader.rank.checkpoints` (``torch.load(weights_only=True)``, with what
  that alone lets a file do checked before and after), :func:`read_json_lines` a file of JSON lines
  (nesting and values bounded by :mod:`grader.rank.wire`); :func:`list_files` lists a
  folder without following links. Each raises :class:`Unreadable`, whose message says what was
  wrong, in words a report can show.
* :func:`read_submission` reads the submission file once (no link, a regular file, at most
  :data:`MAX_SUBMISSION_BYTES`), so that what is graded is a copy the grader made.

A folder the grader made for a grading is registered with :func:`trust_folder`; below it, no
path component may be a link, and nothing outside such a folder is read at all (a path a rank
names cannot lead the grader anywhere else).
"""

from __future__ import annotations

import errno
import io
import os
import re
import stat
import threading

MAX_FILE_BYTES = 64 * 2**20  # the most a check reads of one file a rank left (the default --output-limit)
MAX_SUBMISSION_BYTES = 4 * 2**20  # a submission file larger than this is refused
MAX_LISTED = 20_000  # entries a listing walks before it gives up

# ESC [ ... final byte; ESC ] ... (BEL or ST); ESC P/X/^/_ ... ST; ESC and one byte; the 8-bit forms of each.
_CONTROL = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]?"  # CSI
    r"|\x9b[0-?]*[ -/]*[@-~]?"  # 8-bit CSI
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|$)"  # OSC, DCS, SOS, PM, APC
    r"|\x1b[ -/]*[0-~]?"  # any other escape (and a lone ESC)
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"  # C0 but tab and newline, DEL, C1
    r"|[\u202a-\u202e\u2066-\u2069]",  # bidi embeddings, overrides and isolates: they reorder what follows
    re.S,
)
_BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"

_trusted: set[str] = set()
_through: dict[str, int] = {}  # a trusted folder reached through a descriptor (trust_folder's ``through``)
_lock = threading.Lock()


class Unreadable(Exception):
    """A file a submission left cannot be read as asked; the message says why."""


def clean_text(text: object) -> str:
    """``text`` with every terminal control sequence, control character and bidirectional control removed
    (newline and tab kept)."""
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    if text.isprintable() or not _needs_cleaning(text):
        return text
    return _CONTROL.sub("", text.replace("\r\n", "\n"))


def _needs_cleaning(text: str) -> bool:
    return any(c < " " and c not in "\n\t" or "\x7f" <= c <= "\x9f" or c in _BIDI for c in text)


def clean_line(text: object) -> str:
    """:func:`clean_text` on one line: newlines and tabs become spaces."""
    return clean_text(text).replace("\n", " ").replace("\t", " ")


def trust_folder(path: str, through: int | None = None) -> None:
    """Register a folder the grader itself made: no component below it may be a link. ``through``: a
    descriptor of the folder, held by the caller, through which it is reached (a sandbox's folder, named
    by the path it has inside the sandbox, which is no path of this machine's)."""
    with _lock:
        if through is None:
            _trusted.add(os.path.realpath(path))
        else:
            _trusted.add(os.path.abspath(path))
            _through[os.path.abspath(path)] = through


def forget_folder(path: str) -> None:
    with _lock:
        _trusted.discard(os.path.realpath(path))
        if _through.pop(os.path.abspath(path), None) is not None:
            _trusted.discard(os.path.abspath(path))


def _split(path: str) -> tuple[str, list[str]]:
    """(the trusted folder that holds ``path``, the components below it); ("", [the path]) when none does."""
    full = os.path.abspath(path)
    real_parent = os.path.realpath(os.path.dirname(full))
    candidates = []
    with _lock:
        roots = list(_trusted)
    for root in roots:
        for form in (full, os.path.join(real_parent, os.path.basename(full))):
            if form == root or form.startswith(root.rstrip("/") + "/"):
                candidates.append((root, form))
    if not candidates:
        return "", [full]
    root, form = max(candidates, key=lambda c: len(c[0]))
    rest = form[len(root):].strip("/")
    return root, [p for p in rest.split("/") if p]


def _open(path: str, directory: bool = False) -> int:
    """A descriptor for ``path`` opened without following links below a trusted folder (O_NONBLOCK)."""
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | nofollow
    if directory:
        flags |= getattr(os, "O_DIRECTORY", 0)
    root, parts = _split(path)
    if not root:
        raise Unreadable(f"{os.path.basename(path)} is outside the grading's own folder: the grader reads only "
                         "what the ranks left there")
    with _lock:
        through = _through.get(root)
    try:
        fd = os.open(root if through is None else ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) |
                     getattr(os, "O_CLOEXEC", 0), dir_fd=through)
        try:
            for k, part in enumerate(parts):
                last = k == len(parts) - 1
                step = flags if last else (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | nofollow |
                                           getattr(os, "O_CLOEXEC", 0))
                if part == "..":
                    raise Unreadable(f"{path}: a path that leaves the grading's folder")
                nxt = os.open(part, step, dir_fd=fd)
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) or (exc.errno == errno.EMLINK):
            raise Unreadable(f"{os.path.basename(path)} is a symbolic link (or lies under one): the grader "
                             "reads only files the ranks wrote themselves") from None
        if exc.errno == errno.ENOENT:
            raise Unreadable(f"{os.path.basename(path)} does not exist") from None
        raise Unreadable(f"{os.path.basename(path)} cannot be read: {exc.strerror or exc}") from None


def open_regular(path: str) -> int:
    """A descriptor (blocking reads) for the regular file at ``path``, opened as :func:`read_bytes` opens
    it; Unreadable otherwise. The caller closes it."""
    fd = _open(path)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable(f"{os.path.basename(path)} is not a regular file ({file_kind(info.st_mode)})")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (never through a link, never blocking); Unreadable
    when it is not a regular file, or holds more than ``limit`` bytes."""
    fd = _open(path)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable(f"{os.path.basename(path)} is not a regular file ({file_kind(info.st_mode)})")
        if info.st_size > limit:
            raise Unreadable(f"{os.path.basename(path)} holds {info.st_size:,} bytes; the grader reads at most "
                             f"{limit:,}")
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise Unreadable(f"{os.path.basename(path)} grew past {limit:,} bytes while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str, limit: int = MAX_FILE_BYTES) -> str:
    """:func:`read_bytes` decoded as UTF-8 (undecodable bytes replaced)."""
    return read_bytes(path, limit).decode("utf-8", errors="replace")


def load_tensors(path: str, limit: int = MAX_FILE_BYTES):
    """A checkpoint a rank saved, read as :func:`read_bytes` does and loaded on the CPU by
    :func:`grader.rank.checkpoints.load` (checked before and after ``torch.load(weights_only=True)``);
    Unreadable when it cannot be read or loaded."""
    from grader.rank import checkpoints

    data = read_bytes(path, limit)
    try:
        return checkpoints.load(data)
    except checkpoints.Refused as exc:  # a torn file, a pickle that names a function: the file's fault
        raise Unreadable(f"{os.path.basename(path)} cannot be loaded as a checkpoint: {exc}") from None


def read_json_lines(path: str, budget=None) -> list:
    """The values of the JSON lines of a file a rank wrote, read as :func:`read_bytes` does; each line
    parsed by :func:`grader.rank.wire.parse_json` (its nesting bounded before it is parsed) and charged to
    ``budget`` (a :class:`grader.rank.wire.Budget`). A line that is not JSON, or nests too deep, is left out (a
    line cut short by a kill); Unreadable when the file cannot be read or holds more than the budget."""
    from grader.rank import wire

    budget = budget if budget is not None else wire.Budget()
    values = []
    for line in io.BytesIO(read_bytes(path, budget.bytes)):  # a line at a time: a file of newlines is no list
        if line.isspace():
            continue
        try:
            values.append(wire.parse_json(line, budget))
        except wire.OverBudget as exc:
            raise Unreadable(f"{os.path.basename(path)}: {exc}") from None
        except wire.Unreadable:
            continue
    return values


def lstat(path: str) -> os.stat_result | None:
    """What ``path`` names (a link itself, not followed), or None when nothing; below a trusted folder, as
    reached without links (a sandbox's folder, through the descriptor it is held by)."""
    if not _split(path)[0]:
        try:
            return os.lstat(path)
        except OSError:
            return None
    parent, name = os.path.split(os.path.abspath(path))
    try:
        fd = _open(parent, directory=True)
    except Unreadable:
        return None
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)


def exists(path: str) -> bool:
    """Whether ``path`` names something (a link counts, and is not followed): :func:`lstat`."""
    return lstat(path) is not None


def is_folder(path: str) -> bool:
    """Whether ``path`` is a folder (not a link to one): :func:`lstat`."""
    info = lstat(path)
    return info is not None and stat.S_ISDIR(info.st_mode)


def is_regular(path: str) -> bool:
    """Whether ``path`` is a regular file reached without links."""
    try:
        fd = _open(path)
    except Unreadable:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def list_files(folder: str, recursive: bool = False) -> list[str]:
    """The regular files in ``folder`` (below it too with ``recursive``), as paths, sorted; links and
    other kinds are left out, and nothing is followed. Unreadable when ``folder`` is not a folder
    reached without links, or holds more than MAX_LISTED entries."""
    found: list[str] = []
    seen = 0
    pending = [folder]
    while pending:
        current = pending.pop()
        fd = _open(current, directory=True)
        try:
            names = os.listdir(fd)
            for name in names:
                seen += 1
                if seen > MAX_LISTED:
                    raise Unreadable(f"{os.path.basename(folder)} holds more than {MAX_LISTED:,} entries")
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                path = os.path.join(current, name)
                if stat.S_ISREG(info.st_mode):
                    found.append(path)
                elif stat.S_ISDIR(info.st_mode) and recursive:
                    pending.append(path)
        except FileNotFoundError:
            continue
        finally:
            os.close(fd)
    return sorted(found)


def read_submission(path: str, limit: int = MAX_SUBMISSION_BYTES) -> bytes:
    """The submission file's bytes, read once: refused (Unreadable) when ``path`` is a symbolic link,
    not a regular file, or larger than ``limit``."""
    if os.path.islink(path):
        raise Unreadable(f"{path} is a symbolic link: submit the file itself")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) |
                     getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unreadable(f"{path} is a symbolic link: submit the file itself") from None
        raise Unreadable(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable(f"{path} is not a regular file ({file_kind(info.st_mode)})")
        if info.st_size > limit:
            raise Unreadable(f"{path} holds {info.st_size:,} bytes; a submission may hold at most {limit:,}")
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            data += chunk
        if len(data) > limit:
            raise Unreadable(f"{path} holds more than {limit:,} bytes")
        return data
    finally:
        os.close(fd)


def file_kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words ("a FIFO", "a character device", ...)."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a file"
