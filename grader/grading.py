"""Grade one file: static checks, then the exercise's runs and checks, then a report."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import re
import time
from dataclasses import dataclass

from grader import catalog, learner
from grader.harness import RankOutcome, Session, WorldOutcome, Worker, WorkerDied, WorkerTimeout
from grader.options import DEFAULT_TIMEOUT_S, GradeOptions  # noqa: F401  (GradeOptions: re-exported)
from grader.results import ERROR, FAIL, FAILED, PASS, SKIP, TIMEOUT, UNUSABLE, CheckResult, Report, overall_status

STACK_LINES_PER_RANK = 25


class Abort(Exception):
    """Stop grading this file: the run timed out, crashed or could not start."""

    def __init__(self, status: str, problem: str, details: str = ""):
        super().__init__(problem)
        self.status = status
        self.problem = problem
        self.details = details


class Grading:
    """What an exercise's ``grade`` function works with: runs to start, verdicts to record."""

    def __init__(self, exercise: catalog.Exercise, path: str, session: Session, backend: str,
                 world_sizes: list[int], timeout_s: float, backend_requested: str = "auto",
                 on_event=None):
        self.exercise = exercise
        # on_event(kind, **info), for a live progress line: ("run", driver=, world_size=) before each
        # run, ("worker", driver=) before each worker, ("check", check_id=, status=) after each verdict.
        self.on_event = on_event
        self.backend_requested = backend_requested  # what --backend said: auto, gloo or nccl
        self.path = os.path.abspath(path)
        self.session = session
        self.backend = backend
        self.world_sizes = world_sizes
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._verdicts: dict[str, CheckResult] = {}
        self._clock = time.monotonic()

    # --- starting processes -------------------------------------------------------

    def remaining(self) -> float:
        return max(0.5, self.deadline - time.monotonic())

    def run(self, driver: str, world_size: int, *, kwargs: dict | None = None, env: dict | None = None,
            expect_ok: bool = True, backend: str | None = None) -> WorldOutcome:
        """Run ``driver`` (a function of this exercise's module) on ``world_size`` ranks.

        A timeout always stops the grading. With ``expect_ok`` a rank that raises
        or ends early stops it too, with a message naming the rank and the cause.
        """
        self._notify("run", driver=driver, world_size=world_size)
        outcome = self.session.run(
            self._ref(driver), world_size, learner_path=self.path, timeout_s=self.remaining(),
            backend=backend or self.backend, kwargs=kwargs, env=env,
        )
        if outcome.timed_out:
            raise Abort(TIMEOUT, timeout_problem(outcome, self.timeout_s, self.path),
                        rank_details(outcome.ranks, self.path))
        if expect_ok:
            self.stop_on_failures(outcome)
        return outcome

    def worker(self, driver: str, kwargs: dict | None = None) -> Worker:
        self._notify("worker", driver=driver)
        return self.session.worker(self._ref(driver), learner_path=self.path, timeout_s=self.remaining(),
                                   kwargs=kwargs, backend=self.backend)

    def call(self, worker: Worker, name: str, **kwargs):
        """Call handler ``name`` in ``worker``; its result, or Abort on a timeout or crash."""
        try:
            reply = worker.call(name, **kwargs)
        except WorkerTimeout as exc:
            exc.outcome.status = "killed"
            raise Abort(TIMEOUT, f"timed out after {self.timeout_s:g} s: the call to the learner's code "
                        f"did not return (an endless loop?){learner_location(exc.outcome.stack, self.path)}",
                        rank_details([exc.outcome], self.path)) from None
        except WorkerDied as exc:
            raise Abort(FAILED, "the process running your code " + exc.outcome.describe().split(" ", 2)[2],
                        rank_details([exc.outcome], self.path)) from None
        if reply.get("status") != "ok":
            rank = RankOutcome(0, "error", error=reply.get("error") or {})
            self.stop_on_failures(WorldOutcome(1, [rank]), single=True)
        return reply.get("result")

    def stop_on_failures(self, outcome: WorldOutcome, single: bool = False) -> None:
        """Abort when any rank raised or ended early; the message names the first cause."""
        failures = outcome.failures()
        if not failures:
            if outcome.still_running():  # stopped after another rank failed: cannot happen alone
                raise Abort(FAILED, "a rank was stopped before it finished", rank_details(outcome.ranks, self.path))
            return
        first = _first_cause(failures)
        err = first.error or {}
        if err.get("phase") == "import":
            if err.get("missing"):
                raise Abort(UNUSABLE, f"{os.path.basename(self.path)} does not define {err['missing']}")
            raise Abort(UNUSABLE, f"importing {os.path.basename(self.path)} failed: "
                        f"{err.get('type')}: {err.get('message')}{_at(err)}", err.get("traceback", ""))
        if err.get("type") == "NotImplementedError":
            name = (err.get("where") or {}).get("function") or "a function"
            raise Abort(FAILED, f"not implemented yet: {name}")
        problem = first.describe()
        if single:  # one worker process: "rank 0" would only confuse
            problem = "your code " + problem.split(" ", 2)[2]
        finished = [r for r in outcome.ranks if r.ok]
        if finished and "by peer" in str(err.get("message", "")):
            problem += ("\n(" + ", ".join(f"rank {r.rank}" for r in finished) + " had already finished: rank "
                        f"{first.rank} was left in a collective the others never called. Do all ranks make the "
                        "same collective calls in the same order?)")
        others = [r for r in outcome.ranks if r.status == "killed"]
        if others:
            problem += "; " + ", ".join(f"rank {r.rank}" for r in others) + \
                " could not finish without it and " + ("was" if len(others) == 1 else "were") + " stopped"
        raise Abort(FAILED, problem, rank_details(outcome.ranks, self.path))

    def _notify(self, kind: str, **info) -> None:
        if self.on_event is not None:
            self.on_event(kind, **info)

    def _ref(self, driver: str) -> str:
        return driver if ":" in driver else f"{self.exercise.module}:{driver}"

    # --- recording verdicts -------------------------------------------------------

    def record(self, check_id: str, ok: bool, message: str = "", *, rank: int | None = None,
               world_size: int | None = None) -> bool:
        """Record one observation for a check; a failure is kept over later passes."""
        info = self.exercise.check(check_id)
        now = time.monotonic()
        seconds, self._clock = now - self._clock, now
        previous = self._verdicts.get(check_id)
        if previous is not None and previous.status == FAIL:
            return ok
        status = PASS if ok else FAIL
        self._notify("check", check_id=check_id, status=status)
        if previous is not None and ok:
            previous.seconds += seconds
            return ok
        self._verdicts[check_id] = CheckResult(
            check_id, info.title, status, "" if ok else message, rank, world_size, seconds, info.points,
            "" if ok else info.hint)
        return ok

    def skip(self, check_id: str, reason: str) -> None:
        info = self.exercise.check(check_id)
        self._verdicts[check_id] = CheckResult(check_id, info.title, SKIP, reason, points=info.points)

    def results(self, not_run_reason: str | None) -> list[CheckResult]:
        out = []
        for info in self.exercise.checks:
            verdict = self._verdicts.get(info.id)
            if verdict is None:
                reason = f"not run: {not_run_reason}" if not_run_reason else "not decided by the grader"
                verdict = CheckResult(info.id, info.title, ERROR, reason, points=info.points)
            out.append(verdict)
        return out


def _first_cause(failures: list[RankOutcome]) -> RankOutcome:
    """Prefer a rank that raised over one that only exited, and the earliest one."""
    raised = [r for r in failures if r.status == "error"]
    pool = raised or failures
    return min(pool, key=lambda r: r.seconds)


def _at(err: dict) -> str:
    where = err.get("where")
    return f" (line {where['line']})" if where else ""


# --- messages about stuck or crashed ranks --------------------------------------------


def learner_location(stack: str, learner_path: str) -> str:
    """", at line 14 in setup_ddp, in all_reduce" from a faulthandler dump, or ""."""
    frames = _main_thread_frames(stack)
    if not frames:
        return ""
    base = os.path.basename(learner_path)
    mine = [f for f in frames if os.path.abspath(f[0]) == os.path.abspath(learner_path)]
    innermost = frames[0]
    parts = []
    if mine:
        parts.append(f"at {base} line {mine[0][1]} in {mine[0][2]}")
    if innermost not in mine:
        parts.append(f"inside {innermost[2]} ({_short(innermost[0])})")
    return ": " + ", ".join(parts) if parts else ""


def _main_thread_frames(stack: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the thread that looks like the main one, innermost first."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack.strip())
    chosen = None
    for block in blocks:
        if "Current thread" in block.splitlines()[0] if block else False:
            chosen = block
    for block in blocks:  # the main thread is the one that entered through grader/child.py
        if "grader/child.py" in block or "grader\\child.py" in block:
            chosen = block
    if chosen is None and blocks:
        chosen = blocks[-1]
    frames = []
    for m in re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', chosen or ""):
        frames.append((m.group(1), int(m.group(2)), m.group(3)))
    return frames


def _short(path: str) -> str:
    marker = f"{os.sep}site-packages{os.sep}"
    if marker in path:
        return path.split(marker, 1)[1]
    return os.path.basename(path)


def timeout_problem(outcome: WorldOutcome, timeout_s: float, learner_path: str) -> str:
    stuck = outcome.still_running()
    lines = [f"timed out after {timeout_s:g} s: "
             + (", ".join(f"rank {r.rank}" for r in stuck) or "no rank")
             + (" was" if len(stuck) == 1 else " were") + " still running (a deadlock or an endless loop?)"]
    for r in stuck:
        where = learner_location(r.stack, learner_path)
        lines.append(f"  rank {r.rank}{where or ': no stack was captured'}")
    for r in outcome.failures():
        lines.append(f"  {r.describe()}")
    return "\n".join(lines)


def rank_details(ranks: list[RankOutcome], learner_path: str) -> str:
    """Per-rank tracebacks, stacks and output tails, bounded, for the report's details."""
    parts = []
    for r in ranks:
        chunk = []
        if r.error and r.error.get("traceback"):
            chunk.append(_trim_traceback(r.error["traceback"]))
        if r.stack.strip():
            chunk.append("stack when stopped:\n" + _trim_stack(r.stack))
        if r.output.strip():
            chunk.append("output (last lines):\n" + "\n".join(r.output.rstrip().splitlines()[-15:]))
        if chunk:
            parts.append(f"--- rank {r.rank} ({r.status}) ---\n" + "\n".join(chunk))
    return "\n".join(parts)


def _trim_traceback(tb: str) -> str:
    """Drop the grader's own frames from the top of a traceback."""
    lines = tb.rstrip().splitlines()
    kept, skipping = [], False
    for line in lines:
        if line.startswith('  File "') and ("/grader/" in line or "\\grader\\" in line):
            skipping = True
            continue
        if skipping and line.startswith("    ") and not line.startswith('  File "'):
            continue
        skipping = False
        kept.append(line)
    return "\n".join(kept[-40:])


_PLUMBING = ("/multiprocessing/", "\\multiprocessing\\", "grader/child.py", "grader\\child.py", 'File "<string>"')


def _trim_stack(stack: str) -> str:
    """faulthandler's dump without the process plumbing below the driver."""
    lines = [ln for ln in stack.rstrip().splitlines() if ln.strip() and not any(p in ln for p in _PLUMBING)]
    return "\n".join(lines[:STACK_LINES_PER_RANK]) + ("\n  ..." if len(lines) > STACK_LINES_PER_RANK else "")


# --- the whole grading of one file ----------------------------------------------------


def resolve_backend(requested: str, world_sizes: list[int]) -> str:
    """auto -> nccl when there is one GPU per rank, else gloo; Abort when nccl cannot work."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "nccl" if gpus >= max(world_sizes) and _nccl_available() else "gloo"
    if requested == "nccl":
        if not _nccl_available():
            raise Abort(UNUSABLE, "NCCL is not available in this torch build; use --backend gloo")
        if gpus < max(world_sizes):
            raise Abort(UNUSABLE, f"NCCL needs one GPU per rank: {gpus} GPU(s) here, world size "
                        f"{max(world_sizes)}; use --world-size {max(gpus, 1)} or --backend gloo")
    return requested


def _nccl_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def world_sizes_for(exercise: catalog.Exercise, requested: int | None, backend: str) -> list[int]:
    """The exercise's sizes, with the first replaced by --world-size and an odd one added on CPU."""
    sizes = list(exercise.world_sizes)
    if requested is None:
        return sizes
    if requested < 1:
        raise Abort(UNUSABLE, f"--world-size must be at least 1, not {requested}")
    out = [requested]
    if backend != "nccl" and len(sizes) > 1 and requested % 2 == 0:
        out.append(requested + 1)  # an odd size catches code that assumes two ranks
    return out


def grade_file(path: str, session: Session, options: GradeOptions, exercise_id: str | None = None,
               on_event=None) -> Report:
    """Grade one file and return the report; never raises for a bad submission.

    ``on_event`` is called as the grading goes (see :class:`Grading`), e.g. for a live line.
    """
    started = time.monotonic()
    try:
        exercise = learner.check_file(path, exercise_id)
    except learner.Unusable as exc:
        ex = _guess(path, exercise_id)
        return Report(ex.id if ex else "", ex.title if ex else "", str(path), UNUSABLE, problem=str(exc),
                      seconds=time.monotonic() - started)
    report = Report(exercise.id, exercise.title, str(path), FAILED)
    try:
        probe_sizes = [options.world_size] if options.world_size else list(exercise.world_sizes)
        backend = resolve_backend(options.backend, probe_sizes)
        sizes = world_sizes_for(exercise, options.world_size, backend)
        if backend == "nccl":
            sizes = [s for s in sizes if s <= _gpu_count()] or sizes[:1]
        report.backend, report.world_sizes = backend, sizes
        g = Grading(exercise, path, session, backend, sizes, options.timeout_s, options.backend, on_event)
    except Abort as abort:
        report.status, report.problem = abort.status, abort.problem
        report.seconds = time.monotonic() - started
        return report
    module = importlib.import_module(exercise.module)
    not_run = None
    try:
        with _hypothesis_files_in(session.tmp):
            module.grade(g)
    except Abort as abort:
        report.status, report.problem, report.details = abort.status, abort.problem, abort.details
        not_run = abort.problem.splitlines()[0]
    report.checks = g.results(not_run)
    if report.problem is None:
        report.status = overall_status(report.checks)
    report.seconds = time.monotonic() - started
    return report


@contextlib.contextmanager
def _hypothesis_files_in(folder: str):
    """Keep Hypothesis's cache (it writes ./.hypothesis even without a database) in the
    session's temp folder, never in the learner's working directory."""
    key = "HYPOTHESIS_STORAGE_DIRECTORY"
    before = os.environ.get(key)
    os.environ[key] = os.path.join(folder, "hypothesis")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
        configuration = sys.modules.get("hypothesis.configuration")
        if configuration is not None:
            configuration.set_hypothesis_home_dir(None)  # read the variable again next time


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _guess(path: str, exercise_id: str | None) -> catalog.Exercise | None:
    if exercise_id:
        return catalog.by_id(exercise_id)
    return catalog.from_filename(path)
