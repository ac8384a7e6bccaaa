"""``ddp-grade batch``: grade many submissions, N at a time, one row per submission and check.

How it runs: the batch starts ``--jobs`` worker processes (``python -m grader.batch
--serve``), each with its own warm pool of rank processes (a :class:`~grader.harness.Session`),
and hands each the next submission as soon as it is free. A submission never
shares a process with another one while it is graded, so nothing one does (a
crash, a hang, a patched module) reaches another, and the pools stay warm from
one submission to the next: the cost of starting Python and importing torch is
paid once per worker, not once per submission.

Every worker and everything it starts carries an environment variable with
the worker's own marker, and its temporary files live in a folder the batch
removes; a worker that stops answering (its submission's
timeout plus a margin) is killed with everything carrying its marker, its
submission is reported as timed out, and a fresh worker takes the next one.

Exit code: the worst result of the batch, in this order (worst first):
2 (a submission could not be graded), 3 (one timed out), 1 (a check failed), 0.
"""

from __future__ import annotations

import csv
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import click

from grader import catalog
from grader.options import EXIT_INTERRUPTED, format_option, grading_options, quiet_option
from grader.results import EXIT_CODES, FAILED, PASSED, TIMEOUT, UNUSABLE, Report

BATCH_MARKER = "DDP_GRADE_BATCH"  # environment variable carried by a worker and everything it starts
WORKER_MARGIN_S = 60.0  # a worker silent for timeout + this long is stopped
SEVERITY = [PASSED, FAILED, TIMEOUT, UNUSABLE]  # worst last
EXERCISE_FILE = re.compile(r"^(\d\d)_\w+\.py$")
ROW_FIELDS = ["submission", "file", "exercise", "status", "exit_code", "check", "check_status", "message",
              "points", "seconds"]


@dataclass
class Submission:
    """One file to grade, and the name it has in the table."""

    name: str
    path: str
    exercise: str | None = None  # --exercise, else from the file name
    problem: str | None = None  # set when there is nothing to grade (reported as unusable)


@dataclass
class Outcome:
    submission: Submission
    report: dict = field(default_factory=dict)  # Report.to_dict()

    @property
    def status(self) -> str:
        return self.report.get("status", UNUSABLE)


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
        if p.is_dir():
            files = _exercise_files(p, exercise)
            subdirs = sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith((".", "__")))
            for f in files:
                found.append(Submission(str(f), str(f), exercise))
            for d in subdirs:
                mine = _exercise_files(d, exercise)
                if not mine:
                    if not files:  # a folder of folders: say which learner handed in nothing
                        what = f"no {exercise}_*.py file" if exercise else "no NN_*.py exercise file"
                        found.append(Submission(str(d), str(d), exercise, problem=f"{what} in {d}"))
                    continue
                found.extend(Submission(f"{d.name}/{f.name}", str(f), exercise) for f in mine)
            if not files and not subdirs:
                found.append(Submission(str(p), str(p), exercise, problem=f"no exercise files in {p}"))
        else:  # a file, or a path that does not exist: grading says which
            found.append(Submission(str(p), str(p), exercise))
    return found


def _exercise_files(folder: Path, exercise: str | None) -> list[Path]:
    out = []
    for f in sorted(folder.iterdir()):
        m = EXERCISE_FILE.match(f.name)
        if m and f.is_file() and (exercise is None or m.group(1) == exercise):
            out.append(f)
    return out


# --- the workers -----------------------------------------------------------------------


class WorkerProcess:
    """One ``python -m grader.batch --serve`` process: a submission in, a report out."""

    def __init__(self, settings: dict):
        self.settings = settings
        self.marker = uuid.uuid4().hex
        # The worker's temporary files (its sessions', its pool's) go in a folder this process
        # removes, so they are gone even when the worker has to be killed.
        self.tmp = tempfile.mkdtemp(prefix="ddp-grade-batch-", dir=_short_temp_root())
        env = {**os.environ, BATCH_MARKER: self.marker, "TMPDIR": self.tmp}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grader.batch", "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1, start_new_session=True)
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)  # ended

    def grade(self, submission: Submission, wait_s: float) -> dict | None:
        """The report as a dict; None when the worker died or stopped answering (it is then stopped)."""
        job = {"path": submission.path, "exercise": submission.exercise, **self.settings}
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.replies.get(timeout=wait_s)
        except (OSError, ValueError, queue.Empty):
            line = None
        if line is None:
            died = self.proc.poll()
            self.stop()
            if died is not None:  # it ended by itself: the grader's own failure, said as such
                return _unusable(submission.path, f"the grading worker ended with exit code {died} while "
                                 f"grading this file; try `ddp-grade grade {submission.path}`")
            return None
        try:
            return json.loads(line)
        except ValueError:
            self.stop()
            return None

    def stop(self) -> None:
        """End the worker and everything it started (its ranks carry its marker)."""
        from grader.harness import reap_strays

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
        shutil.rmtree(self.tmp, ignore_errors=True)


def _short_temp_root() -> str:
    """The temp folder, or /tmp when its path is too long for the pool's socket (108 bytes on Linux)."""
    root = tempfile.gettempdir()
    if len(root) > 48 and os.path.isdir("/tmp") and os.access("/tmp", os.W_OK):
        return "/tmp"
    return root


def serve() -> None:
    """The worker's loop: read a job per line on stdin, write the report as one JSON line."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes where stderr goes, never into the replies
    from grader import grading, harness
    from grader.grading import grade_file
    from grader.options import GradeOptions

    grading.warm_up(dynamo=True)
    session = None
    try:
        for line in sys.stdin:
            job = json.loads(line)
            if session is None or session.limits != job["limits"]:
                if session is not None:
                    session.close()
                session = harness.Session(limits=job["limits"])
            options = GradeOptions.from_dict(job)
            try:
                report = grade_file(job["path"], session, options, job["exercise"]).to_dict()
            except Exception as exc:  # the grader's own failure on this file: reported, the batch goes on
                report = _unusable(job["path"], f"the grader failed on this file: {type(exc).__name__}: {exc}")
            out.write(json.dumps(report) + "\n")
    except KeyboardInterrupt:
        pass
    finally:
        if session is not None:
            session.close()


def _unusable(path: str, problem: str, status: str = UNUSABLE) -> dict:
    return Report("", "", path, status, problem=problem).to_dict()


def run_batch(submissions: list[Submission], jobs: int, settings: dict, on_done=None) -> list[Outcome]:
    """Grade every submission with ``jobs`` workers; results in the submissions' order."""
    outcomes = [Outcome(s) for s in submissions]
    todo: queue.Queue = queue.Queue()
    for i, s in enumerate(submissions):
        if s.problem:
            outcomes[i].report = _unusable(s.path, s.problem)
            if on_done:
                on_done(outcomes[i])
        else:
            todo.put(i)
    wait_s = catalog.longest_timeout(settings["timeout_s"]) + WORKER_MARGIN_S
    workers: list[WorkerProcess] = []
    lock = threading.Lock()
    stopping = threading.Event()

    def work() -> None:
        worker = None
        try:
            while not stopping.is_set():
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                if worker is None:
                    worker = WorkerProcess(settings)
                    with lock:
                        workers.append(worker)
                started = time.monotonic()
                report = worker.grade(submissions[i], wait_s)
                if report is None:
                    worker = None
                    if stopping.is_set():
                        return
                    report = _unusable(submissions[i].path, f"grading did not finish within {wait_s:g} s; "
                                       "the grader was stopped", TIMEOUT)
                    report["seconds"] = round(time.monotonic() - started, 3)
                outcomes[i].report = report
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


# --- results -----------------------------------------------------------------------------


def worst_status(outcomes: list[Outcome]) -> str:
    return max((o.status for o in outcomes), key=SEVERITY.index, default=PASSED)


def rows(outcomes: list[Outcome]) -> list[dict]:
    """One row per submission and check (one row with an empty check when none ran)."""
    out = []
    for o in outcomes:
        r = o.report
        base = {"submission": o.submission.name, "file": o.submission.path, "exercise": r.get("exercise", ""),
                "status": o.status, "exit_code": EXIT_CODES[o.status]}
        checks = r.get("checks") or []
        if not checks:
            out.append({**base, "check": "", "check_status": "", "message": r.get("problem") or "",
                        "points": 0, "seconds": r.get("seconds", 0.0)})
        for c in checks:
            out.append({**base, "check": c["id"], "check_status": c["status"], "message": c.get("message", ""),
                        "points": c.get("points", 0) if c["status"] == "pass" else 0,
                        "seconds": round(c.get("seconds", 0.0), 3)})
    return out


def render_table(outcomes: list[Outcome]) -> str:
    """The summary: one line per submission, then the totals."""
    head = ("submission", "ex", "status", "checks", "seconds", "problem")
    lines = []
    for o in outcomes:
        r = o.report
        counts = r.get("counts") or {}
        graded = sum(counts.values()) - counts.get("skip", 0)
        checks = f"{counts.get('pass', 0)}/{graded}" if r.get("checks") else "-"
        problem = (r.get("problem") or "").splitlines()[0] if r.get("problem") else ""
        if not problem and o.status == FAILED:
            problem = "failed: " + ", ".join(c["id"] for c in r.get("checks", []) if c["status"] == "fail")
        lines.append((o.submission.name, r.get("exercise") or "-", o.status, checks,
                      f"{r.get('seconds', 0.0):.1f}", _clip(problem, 70)))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)] if lines else [len(h) for h in head]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    text = [fmt.format(*head), fmt.format(*("-" * w for w in widths[:-1]), "-" * len(head[-1]))]
    text += [fmt.format(*line) for line in lines]
    tally = {s: sum(1 for o in outcomes if o.status == s) for s in SEVERITY}
    worst = worst_status(outcomes)
    text.append("")
    text.append(f"{len(outcomes)} submission{'s' if len(outcomes) != 1 else ''}: {tally[PASSED]} passed, "
                f"{tally[FAILED]} failed, {tally[TIMEOUT]} timed out, {tally[UNUSABLE]} could not be graded "
                f"(exit {EXIT_CODES[worst]}).")
    return "\n".join(text)


def render_json(outcomes: list[Outcome]) -> str:
    worst = worst_status(outcomes)
    return json.dumps({
        "schema": 1,
        "exit_code": EXIT_CODES[worst],
        "status": worst,
        "rows": rows(outcomes),
        "reports": [{"submission": o.submission.name, **o.report} for o in outcomes],
    }, indent=2)


def render_csv(outcomes: list[Outcome]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=ROW_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows(outcomes):
        writer.writerow({**row, "message": row["message"].replace("\n", " | ")})
    return buffer.getvalue()


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def default_jobs() -> int:
    """A quarter of the cores, at least 2.

    A submission runs two or three ranks at once, so a quarter of the cores keeps
    the machine busy without ranks queueing for it; on two cores, two workers still
    overlap one submission's waiting (startup, rendezvous, timeouts) with another's
    work. Measured with benchmarks/bench_batch.py (see docs/guarantees.md).
    """
    return max(2, (os.cpu_count() or 2) // 4)


# --- the command ---------------------------------------------------------------------------


@click.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--exercise", "exercise_id", metavar="NN",
              help="Grade only exercise NN (files in folders: NN_*.py; a file named directly is graded as NN).")
@click.option("-j", "--jobs", type=click.IntRange(min=1, max=64), default=None,
              help="Submissions graded at the same time (default: a quarter of the CPU cores, at least 2).")
@grading_options
@format_option("text", "json", "csv")
@quiet_option
def batch(paths, exercise_id, jobs, options, fmt, quiet):
    """Grade many submissions: files, folders of NN_*.py files, or folders of learners' folders.

    One bad submission (a crash, a hang, a missing file) never stops the rest;
    the exit code is the worst result: 2 (could not grade one) > 3 (timeout) > 1 (failed) > 0.

    \b
    Examples:
      ddp-grade batch submissions/ --exercise 03 --jobs 2
      ddp-grade batch alice/ bob/ --format csv > results.csv
    """
    from grader import catalog

    if exercise_id is not None:
        exercise_id = exercise_id.zfill(2)
        if catalog.by_id(exercise_id) is None:
            known = ", ".join(e.id for e in catalog.exercises())
            raise click.UsageError(f"unknown exercise {exercise_id!r}: choose one of {known}")
    submissions = collect(list(paths), exercise_id)
    settings = options.to_dict()
    total = len(submissions)
    done = [0]

    def progress(outcome: Outcome) -> None:
        done[0] += 1
        if not quiet:
            click.echo(f"[{done[0]}/{total}] {outcome.status:<8} {outcome.submission.name}", err=True)

    try:
        outcomes = run_batch(submissions, jobs or default_jobs(), settings, progress)
    except KeyboardInterrupt:
        click.echo("interrupted: the workers were stopped", err=True)
        raise SystemExit(EXIT_INTERRUPTED)
    if fmt == "json":
        click.echo(render_json(outcomes))
    elif fmt == "csv":
        click.echo(render_csv(outcomes), nl=False)
    else:
        click.echo(render_table(outcomes))
    raise SystemExit(EXIT_CODES[worst_status(outcomes)])


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        batch()
