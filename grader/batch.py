"""``ddp-grade batch``: grade many submissions, N at a time, one row per submission and check.

How it runs: the batch starts ``--jobs`` worker processes (``python -m grader.worker``, the one
out-of-process protocol of :mod:`grader.protocol`) and hands each the next submission as soon as
it is free. The workers decide the verdicts; they never run a submission's code themselves.

With the sandbox (the default where ``bwrap`` or ``unshare`` works, see :mod:`grader.sandbox`)
a worker grades each submission with a fresh sandbox for that submission's ranks alone
(:class:`grader.sandbox.confined.ConfinedSession`): it sees a copy of that one file and none of the
others, and ends with it, so nothing a submission starts survives into the next one's grading,
and nothing it sends decides more than its own row. That costs one Python start and torch import
per submission, inside its sandbox. Without the sandbox each worker keeps its own warm pool of
rank processes (a :class:`~grader.rank.harness.Session`); a submission still never shares a process
with another one while it is graded.

A claim counts for nothing in a batch (:func:`grader.results.count_evidence_only`): a check that passed on what
the submission's own processes recorded about themselves is shown as claimed and scores nothing, and a row
passes only when some check passed on evidence; only ``--no-sandbox`` (a learner's own repository, as
docs/github-actions.yml grades it) counts claims as a plain grading does.

Whatever happens while one submission is graded (its worker dies, its answer cannot be read, the
grader fails on it), the failure is that submission's row, with the reason, and the batch goes on.

Every worker and everything it starts carries an environment variable with
the worker's own marker, and its temporary files live in a folder the batch
removes; a worker that stops answering (its submission's
timeout plus a margin) is killed with everything carrying its marker, its
submission is reported as timed out, and a fresh worker takes the next one.

``--shard I/N`` grades the I-th of N parts (see :mod:`grader.shards`); ``batch merge`` puts
the parts' JSON outputs back together.

Exit code: the worst result of the batch, in this order (worst first):
2 (a submission could not be graded), 3 (one timed out), 1 (a check failed), 0.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from grader import protocol
from grader.batch_output import Outcome, Submission
from grader.options import GradeOptions
from grader.results import (FAILED, GRADER_ERROR, TIMEOUT, UNREADABLE, UNUSABLE, UNUSABLE_FILE, Report, RunProblem,
                            count_evidence_only)

BATCH_MARKER = "DDP_GRADE_BATCH"  # environment variable carried by a worker and everything it starts


# --- finding the submissions ---------------------------------------------------------


def collect(paths: list[str], exercise: str | None = None) -> list[Submission]:
    """The submissions under ``paths``, in a stable order.

    A file is one submission. A folder: each of its ``NN_*.py`` files is one, and
    each of its subfolders is one learner's submission (its ``NN_*.py`` files).
    With ``exercise``, only files for that exercise are taken from folders (a file
    named directly is graded as that exercise whatever its name).
    """
    found: list[Submission] = []
    for raw in paths:
        p = Path(raw)
        if os.path.islink(p):
            found.append(Submission(str(p), str(p), exercise, problem=_linked(p)))
        elif p.is_dir():
            files = _exercise_files(p, exercise)
            subdirs = sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith((".", "__")))
            for f in files:
                found.append(Submission(str(f), str(f), exercise, problem=_not_graded(f)))
            for d in subdirs:
                if d.is_symlink():  # another learner's folder, or one outside the submissions
                    found.append(Submission(d.name, str(d), exercise, problem=_linked(d)))
                    continue
                mine = _exercise_files(d, exercise)
                if not mine:
                    if not files:  # a folder of folders: say which learner handed in nothing
                        what = f"no {exercise}_*.py file" if exercise else "no NN_*.py exercise file"
                        found.append(Submission(str(d), str(d), exercise, problem=f"{what} in {d}"))
                    continue
                found.extend(Submission(f"{d.name}/{f.name}", str(f), exercise, problem=_not_graded(f))
                             for f in mine)
            if not files and not subdirs:
                found.append(Submission(str(p), str(p), exercise, problem=f"no exercise files in {p}"))
        elif os.path.lexists(p) and _unreadable(p):  # a link that leads nowhere, a file it cannot read
            found.append(Submission(str(p), str(p), exercise, problem=_unreadable(p)))
        else:  # a file, or a path that does not exist: grading says which
            found.append(Submission(str(p), str(p), exercise))
    _refuse_shared_files(found)
    return found


def _refuse_shared_files(found: list[Submission]) -> None:
    """Refuse, on every row it is on, a file that is also another submission's under another name (a hard
    link from one learner's folder to another's): which of them wrote it cannot be told."""
    import stat

    from grader.rank.untrusted import clean_line

    by_inode: dict[tuple[int, int], list[Submission]] = {}
    for submission in found:
        try:
            info = os.lstat(submission.path)
        except OSError:
            continue
        if submission.problem is None and stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
            by_inode.setdefault((info.st_dev, info.st_ino), []).append(submission)
    for shared in by_inode.values():
        if len({os.path.abspath(s.path) for s in shared}) < 2:  # one path named twice: the same submission
            continue
        for submission in shared:
            others = ", ".join(clean_line(o.name) for o in shared if o is not submission)
            submission.problem = (f"{clean_line(submission.name)} is the same file as {others} (a hard link): "
                                  "only a submission's own files are graded (copy the file itself)")


def _linked(path: Path) -> str:
    """Why a submission that is a symbolic link is not graded (its target is never read or named)."""
    from grader.rank.untrusted import clean_line

    return (f"{clean_line(path)} is a symbolic link: only a submission's own files are graded "
            "(copy the file itself into the submission)")


def _not_graded(path: Path) -> str | None:
    """Why a file found in a folder is not graded (a link; a FIFO, a socket or a device, never opened), or None."""
    import stat

    from grader.rank.untrusted import clean_line, file_kind

    if path.is_symlink():
        return _linked(path)
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None  # gone since it was listed: grading says so
    if stat.S_ISREG(mode):
        return None
    return f"{clean_line(path)} is not a regular file ({file_kind(mode)}): give the exercise file itself"


def _unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be graded as a file (the path named), or None when it can be read."""
    from grader import learner

    try:
        learner.read_source(path)
    except learner.Unusable as exc:
        return str(exc)
    return None


def _exercise_files(folder: Path, exercise: str | None) -> list[Path]:
    """The files in ``folder`` named for an exercise of the catalog (``03_train.py``, ``03_mine.py``)."""
    from grader import catalog

    out = []
    for f in sorted(folder.iterdir()):
        ex = catalog.from_filename(f) if f.suffix == ".py" else None
        # A FIFO or a device named like an exercise file is kept: its row says it is not graded.
        if ex is not None and (f.is_symlink() or not f.is_dir()) and (exercise is None or ex.id == exercise):
            out.append(f)
    return out


# --- the workers -----------------------------------------------------------------------


MAX_ANSWER_LINE = 64 * 2**20  # the longest line a worker's answer may hold (a report is far smaller)


class WorkerProcess:
    """One ``python -m grader.worker`` process: a submission in, a report out (:mod:`grader.protocol`).

    The worker runs outside any sandbox and decides every verdict. With ``sandbox`` (a tool name
    from :mod:`grader.sandbox`) it starts, for each submission, a fresh sandbox for that
    submission's ranks alone (:func:`grader.protocol.grade_in_sandbox`), which sees a copy of
    that one file and nothing of the others; without, its own warm pool runs the ranks.
    """

    def __init__(self, settings: dict, sandbox: str | None = None, dynamo: bool = True, exercises: tuple = (),
                 claims_count: bool = False):
        self.options = GradeOptions.from_dict(settings)
        self.marker = uuid.uuid4().hex
        self.sandbox = sandbox
        self.claims_count = claims_count
        argv = [sys.executable, "-m", "grader.worker"]
        extra = {protocol.DYNAMO_ENV: "1" if dynamo else "0", **protocol.exercise_env(exercises)}
        if sandbox:
            extra[protocol.POOL_ENV] = "0"  # every ranks' pool is in a sandbox: none here
        # The worker's temporary files (its sessions', its pool's, its sandboxes' folders) go in a
        # folder this process removes, so they are gone even when the worker has to be killed.
        self.tmp = tempfile.mkdtemp(prefix="ddp-grade-batch-", dir=_short_temp_root())
        env = {**os.environ, **extra, BATCH_MARKER: self.marker, "TMPDIR": self.tmp}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1,
                                     start_new_session=True)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                line = self.proc.stdout.readline(MAX_ANSWER_LINE)
                if not line:
                    break
                if len(line) >= MAX_ANSWER_LINE and not line.endswith("\n"):
                    self.replies.put(json.dumps({"type": "error", "why": "the worker sent a line longer than "
                                                 f"{MAX_ANSWER_LINE:,} characters"}))
                    break
                self.replies.put(line)
        except (OSError, ValueError):
            pass
        self.replies.put(None)  # ended

    def _lines(self, until: float):
        """The worker's answer lines, until it ends or ``until`` (monotonic) passes."""
        while True:
            line = self.replies.get(timeout=max(0.0, until - time.monotonic()))
            if line is None:
                return
            yield line

    def grade(self, submission: Submission, wait_s: float) -> dict | None:
        """The report as a dict; None when the worker stopped answering (it is then stopped)."""
        request = protocol.request(submission.path, submission.exercise, self.options, shown_as=submission.path,
                                   sandbox=self.sandbox)
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            report = protocol.read_answer(self._lines(time.monotonic() + wait_s), request_id=request["id"])
            report.path = submission.path
            if not self.claims_count:
                count_evidence_only(report)
            return _readable(report.to_dict())
        except queue.Empty:
            self.stop()
            return None
        except protocol.Unreadable as exc:  # not the worker's: unsandboxed, a rank can write into its output
            if self.proc.poll() is None:
                self.stop()
                return _unusable(submission.path, f"the answer for this file cannot be read ({exc}): the "
                                 "submission's ranks wrote into the grading worker's output", status=FAILED,
                                 kind=UNREADABLE)
            return self._failed(submission, exc)
        except Exception as exc:  # the worker's failure on this file: this row's
            return self._failed(submission, exc)

    def _failed(self, submission: Submission, exc: Exception) -> dict:
        died = self.proc.poll()
        self.stop()
        if died is not None:  # it ended by itself: the grader's own failure, said as such
            why = f"the grading worker ended with exit code {died} while grading this file"
        else:
            why = f"the grading worker failed on this file: {type(exc).__name__}: {exc}"
        return _unusable(submission.path, f"{why}; try `ddp-grade grade {submission.path}`")

    def stop(self) -> None:
        """End the worker and everything it started (its ranks and sandboxes carry its marker)."""
        from grader.rank.harness import reap_strays

        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.kill()
            self.proc.wait()
        reap_strays(self.marker, BATCH_MARKER)
        if self.tmp:
            from grader.rank.processes import remove_folder

            remove_folder(self.tmp)


def _short_temp_root() -> str:
    """The temp folder, or /tmp when its path is too long for the pool's socket (108 bytes on Linux)."""
    root = tempfile.gettempdir()
    if len(root) > 48 and os.path.isdir("/tmp") and os.access("/tmp", os.W_OK):
        return "/tmp"
    return root


def _readable(data: dict) -> dict:
    """A report as the grading protocol sends it (``Report.to_dict``), as the JSON report shows it (prose added)."""
    from grader.report import json_dict
    from grader.results import report_from_dict

    return json_dict(report_from_dict(data))


def _unusable(path: str, problem: str, status: str = UNUSABLE, exception: str = "",
              kind: str = GRADER_ERROR) -> dict:
    """The report of a submission the batch could not grade: nothing to grade, or the grading itself failed."""
    return _readable(Report("", "", path, status, run_problem=RunProblem(kind, status, exception=exception,
                                                                           message=problem)).to_dict())


def run_batch(submissions: list[Submission], jobs: int, settings: dict, on_done=None, on_start=None,
              sandbox: str | None = None, claims_count: bool = False) -> list[Outcome]:
    """Grade every submission with ``jobs`` workers; results in the submissions' order.

    ``on_start(submission)`` and ``on_done(outcome)`` are called as each starts and ends;
    ``sandbox``: the tool (see :mod:`grader.sandbox`) that gives each submission a fresh sandbox;
    ``claims_count``: a check that passed on a claim counts as in a plain grading (``batch --no-sandbox``, a
    learner grading their own repository), not as claimed.
    """
    outcomes = [Outcome(s) for s in submissions]
    todo: queue.Queue = queue.Queue()
    for i, s in enumerate(submissions):
        if s.problem:
            outcomes[i].report = _unusable(s.path, s.problem, kind=UNUSABLE_FILE)
            if on_done:
                on_done(outcomes[i])
        else:
            todo.put(i)
    options = GradeOptions.from_dict(settings)
    workers: list[WorkerProcess] = []
    lock = threading.Lock()
    stopping = threading.Event()

    def next_index() -> int | None:
        try:
            return todo.get_nowait()
        except queue.Empty:
            return None

    every = tuple(_exercise(submissions[i]) for i in list(todo.queue))  # what a worker may grade

    def start() -> WorkerProcess:
        worker = WorkerProcess(settings, sandbox, claims_count=claims_count, dynamo=any(_needs_dynamo(submissions[i]) for i in list(todo.queue))
                               or not sandbox, exercises=every)
        with lock:
            workers.append(worker)
        return worker

    def grade_one(worker: WorkerProcess | None, i: int) -> tuple[WorkerProcess | None, dict]:
        """(the worker to go on with, the submission's report): whatever happens, this row has a report."""
        started = time.monotonic()
        try:
            worker = worker or start()
            wait_s = protocol.wait_s(submissions[i].path, submissions[i].exercise, options) + \
                (protocol.SANDBOX_START_S if sandbox else 0.0)
            report = worker.grade(submissions[i], wait_s)
            if report is not None and worker.proc.poll() is not None:  # stopped after a failure on this file
                return None, report
            if report is None:
                report = _unusable(submissions[i].path, f"grading did not finish within {wait_s:g} s; "
                                   "the grader was stopped", TIMEOUT)
                report["seconds"] = round(time.monotonic() - started, 3)
                return None, report
            return worker, report
        except Exception as exc:  # the batch's own failure on this submission: this row says so, the rest go on
            if worker is not None:
                worker.stop()
            return None, _unusable(submissions[i].path, f"the batch failed on this file: {type(exc).__name__}: {exc}")

    def work() -> None:
        worker = None
        try:
            while not stopping.is_set():
                i = next_index()
                if i is None:
                    return
                if on_start:
                    on_start(submissions[i])
                worker, outcomes[i].report = grade_one(worker, i)
                if stopping.is_set():
                    return
                if on_done:
                    on_done(outcomes[i])
        finally:
            if worker is not None:
                worker.stop()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, min(jobs, todo.qsize())))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except KeyboardInterrupt:
        stopping.set()
        with lock:
            for w in workers:
                w.stop()
        raise
    return outcomes


def _exercise(submission: Submission):
    """The submission's catalog entry, or None when its name does not say."""
    from grader import catalog

    return catalog.by_id(submission.exercise) if submission.exercise else catalog.from_filename(submission.path)


def _needs_dynamo(submission: Submission) -> bool:
    """Whether the submission's exercise builds a DDP or a torch optimizer (unknown: assume so)."""
    ex = _exercise(submission)
    return ex is None or ex.preload_dynamo


def default_jobs() -> int:
    """A quarter of the cores, at least 2.

    A submission runs two or three ranks at once, so a quarter of the cores keeps
    the machine busy without ranks queueing for it; on two cores, two workers still
    overlap one submission's waiting (startup, rendezvous, timeouts) with another's
    work. Measured with benchmarks/bench_batch.py (see docs/guarantees.md).
    """
    return max(2, (os.cpu_count() or 2) // 4)
