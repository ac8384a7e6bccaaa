"""Grade one file: static checks, then the exercise's runs and checks, then a report."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

from grader import catalog, diagnose, learner
from grader.rank.harness import RankOutcome, Session, World, WorldOutcome, Worker, WorkerDied, WorkerTimeout
from grader.rank.outcomes import SessionBroken
from grader.options import DEFAULT_TIMEOUT_S, GradeOptions  # noqa: F401  (re-exported for callers)
from grader.results import (BAD_OPTION, CHECK_STOPPED, ERROR, FAIL, FAILED, NOT_CHECKED, PASS, SKIP, UNREADABLE,
                            UNUSABLE, UNUSABLE_FILE,
                            CheckResult, Report, RunProblem, overall_status)


RANK_SIDE = "grader.rank."  # the one package a rank imports from (the sandbox holds no other of the kit)
DRIVER_MODULES = ["grader.rank.drivers.preload"]  # every exercise's drivers, imported once in the warm pool


def warm_up(dynamo: bool = True, exercises: list | None = None) -> None:
    """Start the warm pool with torch and the drivers imported (see harness.warm_up): those of
    ``exercises`` (catalog entries) when a command knows it grades those only, every exercise's
    otherwise. A rank of another exercise imports its module itself: slower, never wrong."""
    from grader.rank import harness

    harness.warm_up(dynamo=dynamo, modules=driver_modules(exercises))


def driver_modules(exercises: list | None) -> list[str]:
    """The modules a pool preloads for ``exercises`` (any None, or none given: every exercise's)."""
    if not exercises or None in exercises:
        return DRIVER_MODULES
    return sorted({e.drivers for e in exercises})


class Abort(BaseException):
    """Stop grading this file: carries the :class:`RunProblem` that says why.

    A BaseException, so that nothing between a check and :func:`grade_file` swallows it: not a
    check's ``except Exception``, and not Hypothesis, which only catches Exception.
    """

    def __init__(self, problem: RunProblem):
        super().__init__(problem.kind)
        self.problem = problem


@dataclass(frozen=True)
class Plan:
    """Where a grading runs: the backend and the world sizes, settled once from the options."""

    backend: str  # gloo or nccl
    world_sizes: list[int]
    backend_requested: str = "auto"  # what --backend said


@dataclass(frozen=True)
class Run:
    """One run for :meth:`Grading.run_at_once`; the fields mean what ``Grading.run``'s arguments do."""

    driver: Callable | str
    world_size: int
    kwargs: dict | None = None
    env: dict | None = None
    label: str | None = None
    expect_ok: bool = True
    traffic: bool = False


def driver_name(driver: Callable | str) -> str:
    """What the live line calls a driver: its function's name."""
    return driver.rsplit(":", 1)[-1] if isinstance(driver, str) else driver.__name__


def driver_ref(driver: Callable | str, module: str) -> str:
    """``"module:function"``, by which a rank imports ``driver``: a function of a module of the rank side
    (:mod:`grader.rank`) as it is named there; one a factory made (``rank_main = debug_rank.job_driver(...)``)
    by the name the exercise's drivers ``module`` gives it. A string is a name in ``module``, or already
    ``"module:function"``. ValueError for a function outside the rank side: a sandbox holds nothing else."""
    if isinstance(driver, str):
        ref = driver if ":" in driver else f"{module}:{driver}"
    else:
        ref = None
        home = sys.modules.get(driver.__module__)
        if home is not None and getattr(home, driver.__qualname__, None) is driver:
            ref = f"{driver.__module__}:{driver.__qualname__}"
        for attr, value in vars(sys.modules.get(module) or object()).items():
            if ref is None and value is driver:
                ref = f"{module}:{attr}"
        if ref is None:
            raise ValueError(f"{driver.__qualname__} is not a function a rank can import: name it in {module}")
    if not ref.startswith(RANK_SIDE):
        raise ValueError(f"{ref} is not on the rank side: a rank runs only what {RANK_SIDE.rstrip('.')} holds")
    return ref


def _together(runs: list[Run]) -> str:
    """The live line's words for runs started at once: "rank_main on 2, 3, 2 ranks and defaults_main on 1 rank"."""
    sizes: dict[str, list[int]] = {}
    for r in runs:
        sizes.setdefault(driver_name(r.driver), []).append(r.world_size)
    parts = [f"{driver} on {', '.join(map(str, n))} rank{'s' if n != [1] else ''}" for driver, n in sizes.items()]
    return " and ".join(parts) + " at once"


class Grading:
    """What an exercise's ``grade`` function works with: runs to start, verdicts to record."""

    Stopped = Abort  # what ``stop`` raises, for checks that must let it pass (e.g. through Hypothesis)
    Run = Run  # what ``run_at_once`` takes (check modules do not import this layer)

    def __init__(self, exercise: catalog.Exercise, path: str, session: Session, plan: Plan, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, on_event=None):
        self.exercise = exercise
        self.path = os.path.abspath(path)
        self.session = session
        self.plan = plan
        self.timeout_s = timeout_s
        # on_event(kind, **info), for a live progress line: ("run", driver=, world_size=) before each
        # run, ("worker", driver=) before each worker, ("check", check_id=, status=) after each verdict.
        self.on_event = on_event
        self.deadline = time.monotonic() + timeout_s
        self._verdicts: dict[str, CheckResult] = {}
        self._clock = time.monotonic()
        self.sizes_run: list[int] = []  # the world sizes of the process groups actually run
        self.in_one_process = False  # a worker process ran the learner's code (no process group)
        self.sections: list[dict] = []  # see section()

    @property
    def backend(self) -> str:
        return self.plan.backend

    @property
    def backend_requested(self) -> str:
        return self.plan.backend_requested

    @property
    def world_sizes(self) -> list[int]:
        return self.plan.world_sizes

    # --- starting processes -------------------------------------------------------

    def remaining(self) -> float:
        return max(0.5, self.deadline - time.monotonic())

    def run(self, driver: Callable | str, world_size: int, *, kwargs: dict | None = None, env: dict | None = None,
            expect_ok: bool = True, backend: str | None = None, label: str | None = None,
            graded_size: int | None = None, traffic: bool = False) -> WorldOutcome:
        """Run ``driver`` (a rank-side function of this exercise's checks) on ``world_size`` ranks.

        A timeout always stops the grading. With ``expect_ok`` a rank that raises
        or ends early stops it too, with the rank and the cause. ``label`` says on the live line
        what the run does when its processes are not the ranks of one group (e.g. several
        launchers); ``graded_size`` is then the world size it grades (for the report's header).
        With ``traffic`` the kernel counts the bytes between the ranks (``outcome.traffic``, a
        :class:`grader.traffic.RunTraffic`; None where its counters cannot be read).
        """
        self._notify("run", driver=driver_name(driver), world_size=world_size, label=label)
        self._graded(graded_size if graded_size is not None else (None if label else world_size))
        with _counted(self.session, traffic) as counting:
            outcome = self.session.run(
                self._ref(driver), world_size, learner_path=self.path, timeout_s=self.remaining(),
                backend=backend or self.backend, kwargs=kwargs, env={**(env or {}), **counting.env},
            )
        counting.attach([outcome])
        self.deadline += outcome.start_s  # starting the ranks is the grader's time
        self._stop_on_problems(outcome, expect_ok)
        return outcome

    def run_at_once(self, runs: list[Run]):
        """Start every run in ``runs`` at the same time; yield their outcomes in order.

        Each outcome gets the checks ``run`` makes (a timeout, a failing rank with ``expect_ok``)
        just before it is yielded, so a grading that reads them in order stops where the same
        runs one after another would have stopped, with the same verdicts recorded. A re-grade
        waits for the slowest run instead of for their sum. For light exercises only: every
        rank of every run is alive at once.
        """
        runs = list(runs)
        self._notify("run", driver=driver_name(runs[0].driver), world_size=max(r.world_size for r in runs),
                     label=_together(runs))
        for r in runs:
            self._graded(None if r.label else r.world_size)
        with _counted(self.session, any(r.traffic for r in runs)) as counting:
            worlds = [World(self._ref(r.driver), r.world_size, r.kwargs, {**(r.env or {}), **counting.env}
                            if r.traffic else r.env) for r in runs]
            outcomes = self.session.run_many(worlds, learner_path=self.path, timeout_s=self.remaining(),
                                             backend=self.backend, last_read_on_failure=[r.expect_ok for r in runs])
        counting.attach([o for r, o in zip(runs, outcomes) if r.traffic])
        self.deadline += outcomes[0].start_s if outcomes else 0.0  # one start for them all: the grader's time
        for r, outcome in zip(runs, outcomes):
            self._stop_on_problems(outcome, r.expect_ok)
            yield outcome

    def _graded(self, size: int | None) -> None:
        """Note a world size a run grades (None: the run is not one group), for the report's header."""
        if size is not None and size not in self.sizes_run:
            self.sizes_run.append(size)

    def _stop_on_problems(self, outcome: WorldOutcome, expect_ok: bool) -> None:
        if outcome.timed_out:
            problem = diagnose.timeout_problem(outcome, self.timeout_s, self.path)
            self._keep_stopped_timeline(outcome, "timed out")
            raise Abort(problem)
        if expect_ok:
            self.stop_on_failures(outcome)

    def worker(self, driver: Callable | str, kwargs: dict | None = None) -> Worker:
        self._notify("worker", driver=driver_name(driver))
        self.in_one_process = True
        return self.session.worker(self._ref(driver), learner_path=self.path, timeout_s=self.remaining(),
                                   kwargs=kwargs, backend=self.backend)

    def call(self, worker: Worker, name: str, **kwargs):
        """Call handler ``name`` in ``worker``; its result, or stop on a timeout or crash."""
        try:
            reply = worker.call(name, **kwargs)
        except WorkerTimeout as exc:
            exc.outcome.status = "killed"
            raise Abort(diagnose.timeout_problem(WorldOutcome(1, [exc.outcome], timed_out=True), self.timeout_s,
                                                 self.path, single=True)) from None
        except WorkerDied as exc:
            raise Abort(diagnose.failure_problem(WorldOutcome(1, [exc.outcome]), self.path, single=True)) from None
        if reply.get("status") != "ok":
            rank = RankOutcome(0, "error", error=reply.get("error") or {})
            self.stop_on_failures(WorldOutcome(1, [rank]), single=True)
        return reply.get("result")

    def try_call(self, worker: Worker, name: str, *, within_s: float, **kwargs):
        """Call handler ``name`` in ``worker``; its result, or None when it raised there, crashed or
        took more than ``within_s`` (the worker is stopped then). Nothing is recorded either way:
        for a shortcut whose every failure is decided again the usual way."""
        try:
            reply = worker.call(name, within_s=within_s, **kwargs)
        except (WorkerTimeout, WorkerDied):
            return None
        return reply.get("result") if reply.get("status") == "ok" else None

    def stop_on_failures(self, outcome: WorldOutcome, single: bool = False) -> None:
        """Stop the grading when any rank raised or ended early; the problem names the first cause."""
        problem = diagnose.failure_problem(outcome, self.path, single=single)
        if problem is not None:
            if not single:
                self._keep_stopped_timeline(outcome, "stopped: a rank failed")
            raise Abort(problem)

    def _keep_stopped_timeline(self, outcome: WorldOutcome, why: str) -> None:
        """The lanes of a run the grader stopped (a timeout, a crash), from what its ranks flushed as they went
        (grader.timeline.stopped_run), as a timeline section: drawn in the page and under -v, each rank's
        blocking call still under way marked. Nothing when the run's driver recorded none."""
        from grader import timeline

        if not outcome.run_dir:
            return
        now = time.monotonic()
        started = now - float(outcome.seconds or 0.0) - float(outcome.start_s or 0.0)
        try:
            run = timeline.stopped_run(outcome.run_dir, outcome.world_size, window=(started, now),
                                       label=f"world size {outcome.world_size}, {why}", problem=why)
        except Exception:  # what the ranks wrote must never stop the report of why they stopped
            run = None
        if run is not None:
            self.section(f"what each rank did over time: {run['label']}", timeline.summary(run), {timeline.KEY: run})

    def stop(self, message: str, *, status: str = FAILED, world_size: int | None = None,
             rank: int | None = None) -> None:
        """Stop the grading: nothing after this can be checked (``message`` says why, to the learner)."""
        raise Abort(RunProblem(CHECK_STOPPED, status, rank=rank, world_size=world_size, message=message,
                               file=os.path.basename(self.path)))

    def not_implemented(self, name: str) -> None:
        """Stop the grading: the learner's ``name`` still raises NotImplementedError."""
        from grader.results import NOT_IMPLEMENTED

        raise Abort(RunProblem(NOT_IMPLEMENTED, FAILED, name=name, file=os.path.basename(self.path)))

    @staticmethod
    def with_context(exc: BaseException, context: str) -> BaseException:
        """A stop with ``context`` (what the grader was doing) added; any other exception unchanged."""
        if isinstance(exc, Abort):
            exc.problem.context = context
        return exc

    def _notify(self, kind: str, **info) -> None:
        if self.on_event is not None:
            self.on_event(kind, **info)

    def _ref(self, driver: Callable | str) -> str:
        return driver_ref(driver, self.exercise.drivers)

    # --- recording verdicts -------------------------------------------------------

    def record(self, check_id: str, ok: bool, message: str = "", *, rank: int | None = None,
               world_size: int | None = None, evidence: str | None = None) -> bool:
        """Record one observation for a check; a failure is kept over later passes. ``evidence``: what this
        verdict stood on where it is not what the catalog says (a kernel check decided on a claim where the
        kernel's counters could not be read)."""
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
        # The debugging track trains the diagnosis: its report says what was seen, and the check's
        # hint (the way to the fix) stays behind `ddp-grade hint NN --check ID`.
        hint = "" if ok or self.exercise.is_debug else info.hint
        self._verdicts[check_id] = CheckResult(
            check_id, info.title, status, "" if ok else message, rank, world_size, seconds, info.points, hint,
            evidence=evidence or info.evidence)
        return ok

    def not_checked(self, check_id: str, because: str, reason: str, *, world_size: int | None = None) -> None:
        """Check ``check_id`` could not be decided because check ``because`` failed: shown as not
        checked (neither passed nor failed), pointing at ``because``. A failure already recorded stays."""
        previous = self._verdicts.get(check_id)
        if previous is not None and previous.status == FAIL:
            return
        info = self.exercise.check(check_id)
        self._notify("check", check_id=check_id, status=NOT_CHECKED)
        self._verdicts[check_id] = CheckResult(check_id, info.title, NOT_CHECKED, f"not checked: {reason}",
                                               world_size=world_size, points=info.points, likely_cause=because,
                                               evidence=info.evidence)

    def section(self, title: str, text: str, data: dict | None = None) -> None:
        """Add what the grading observed beyond verdicts to the report (e.g. the schedule each rank ran).

        ``text`` is shown under the checks, ``data`` (plain JSON values) goes into the JSON report.
        Kept when the grading stops later.
        """
        self.sections.append({"title": title, "text": text, "data": data or {}})

    def add_timeline(self, entries: list[dict]) -> None:
        """Events of a whole job, in order, as the report's timeline section: plain dicts, each with a
        "text" line (the text report shows the lines, the JSON report the events)."""
        self.section("timeline (what the grader saw)", "\n".join(e.get("text", "") for e in entries),
                     {"events": [dict(e) for e in entries]})

    def skip(self, check_id: str, reason: str) -> None:
        info = self.exercise.check(check_id)
        self._verdicts[check_id] = CheckResult(check_id, info.title, SKIP, reason, points=info.points,
                                               evidence=info.evidence)

    def results(self, not_run_reason: str | None) -> list[CheckResult]:
        """Every check's verdict in catalog order; a failure another failed check explains says so."""
        out = []
        for info in self.exercise.checks:
            verdict = self._verdicts.get(info.id)
            if verdict is None:
                reason = f"not run: {not_run_reason}" if not_run_reason else "not decided by the grader"
                verdict = CheckResult(info.id, info.title, ERROR, reason, points=info.points, evidence=info.evidence)
            out.append(verdict)
        failed = {c.id for c in out if c.status == FAIL}
        for verdict in out:
            cause = next((c for c in self.exercise.check(verdict.id).after if c in failed), None)
            if verdict.status == FAIL and cause is not None:
                verdict.likely_cause = cause
                verdict.hint = f"{cause} failed too, and it explains this failure: fix {cause} first."
        return out


class _Counting:
    """The kernel's count of the runs started in a ``with _counted(...)`` block (grader.traffic)."""

    def __init__(self, session, wanted: bool):
        from grader import traffic

        self.found = traffic.meter_for(session) if wanted else None
        self.counted = None

    @property
    def env(self) -> dict:
        return self.found[0].env if self.found else {}

    def stop(self) -> None:
        if self.found and self.counted is None:
            self.counted = self.found[0].stop()

    def attach(self, outcomes: list) -> None:
        """Give each outcome its ranks' traffic (None where it was not counted)."""
        from grader import traffic

        for outcome in outcomes:
            outcome.traffic = None if self.counted is None else \
                traffic.of_run(self.counted, outcome, self.found[1], self.found[2])


@contextlib.contextmanager
def _counted(session, wanted: bool):
    counting = _Counting(session, wanted)
    try:
        yield counting
    finally:
        counting.stop()


def _bad_option(message: str) -> Abort:
    return Abort(RunProblem(BAD_OPTION, UNUSABLE, message=message))


# --- the whole grading of one file ----------------------------------------------------


def plan(exercise: catalog.Exercise, options: GradeOptions, gpus: int | None = None,
         nccl: bool | None = None) -> Plan:
    """The backend and world sizes for grading ``exercise`` under ``options`` (Abort when they cannot work).

    auto -> nccl when there is one GPU per rank and NCCL is built in, else gloo. The exercise's
    sizes are used unless --world-size names one; on gloo an even size is joined by the next odd
    one (code that assumes two ranks shows there). NCCL runs only the sizes that have a GPU per rank.
    """
    if options.world_size is not None and options.world_size < 1:
        raise _bad_option(f"--world-size must be at least 1, not {options.world_size}")
    gpus = _gpu_count() if gpus is None else gpus
    nccl = _nccl_available() if nccl is None else nccl
    wanted = [options.world_size] if options.world_size else list(exercise.world_sizes)
    requested = options.backend
    if exercise.is_debug:  # the broken jobs are CPU scripts: they join with gloo whatever the machine has
        if requested == "nccl":
            raise _bad_option(f"exercise {exercise.id} is a CPU job (gloo): grade it with --backend gloo or auto")
        requested = "gloo"
    if requested == "auto":
        backend = "nccl" if nccl and gpus >= max(wanted) else "gloo"
    elif requested == "nccl" and not nccl:
        raise _bad_option("NCCL is not available in this torch build; use --backend gloo")
    elif requested == "nccl" and gpus < max(wanted):
        raise _bad_option(f"NCCL needs one GPU per rank: {gpus} GPU(s) here, world size {max(wanted)}; "
                          f"use --world-size {max(gpus, 1)} or --backend gloo")
    else:
        backend = requested
    sizes = list(exercise.world_sizes)
    if options.world_size is not None:
        sizes = [options.world_size]
        if backend != "nccl" and len(exercise.world_sizes) > 1 and options.world_size % 2 == 0:
            sizes.append(options.world_size + 1)  # an odd size catches code that assumes two ranks
    if backend == "nccl":
        sizes = [s for s in sizes if s <= gpus] or sizes[:1]
    return Plan(backend, sizes, options.backend)


def _nccl_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _one_compute_thread() -> None:
    """The grader's own replays are tiny. With a second compute thread, torch's thread pool spins
    while it waits for a core that the ranks keep busy: on 2 cores that took 0.15 s of CPU from a
    grading of 03, against 0.06 s with one thread."""
    import torch

    torch.set_num_threads(1)


def deadline_s(exercise: catalog.Exercise | None, options: GradeOptions) -> float:
    """The wall time one grading may take: ``--timeout``, or the exercise's own least deadline when it
    is longer (15 runs whole torchrun jobs); for a file of no known exercise, the longest of any."""
    if exercise is None:
        return catalog.longest_timeout(options.timeout_s)
    return max(options.timeout_s, exercise.timeout_s)


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
        return Report(ex.id if ex else "", ex.title if ex else "", str(path), UNUSABLE,
                      run_problem=RunProblem(UNUSABLE_FILE, UNUSABLE, message=str(exc),
                                             file=os.path.basename(str(path))),
                      seconds=time.monotonic() - started)
    report = Report(exercise.id, exercise.title, str(path), FAILED)
    try:
        settled = plan(exercise, options)
    except Abort as abort:
        report.status, report.run_problem = abort.problem.status, abort.problem
        report.seconds = time.monotonic() - started
        return report
    report.backend, report.world_sizes = settled.backend, list(settled.world_sizes)
    # The checks' module first: importing it (torch, in a cold process) is the grader's time, and the
    # deadline starts with the Grading.
    module = importlib.import_module(exercise.module)
    g = Grading(exercise, path, session, settled, timeout_s=deadline_s(exercise, options), on_event=on_event)
    _one_compute_thread()
    not_run = None
    try:
        with _hypothesis_files_in(session.tmp):
            module.grade(g)
    except Abort as abort:
        report.status, report.run_problem = abort.problem.status, abort.problem
        not_run = "the grading stopped before it (the problem above says why)"
    except SessionBroken as exc:  # the submission ended its sandbox (a limit), or sent what cannot be read
        report.status = FAILED
        report.run_problem = RunProblem(UNREADABLE, FAILED, message=str(exc), file=os.path.basename(path),
                                        evidence={"limit": exc.limit} if exc.limit else {})
        not_run = "the grading stopped before it (the problem above says why)"
    except Exception as exc:  # a check could not read what the ranks sent: the submission's failure
        report.status = FAILED
        report.run_problem = RunProblem(UNREADABLE, FAILED, exception=type(exc).__name__, message=(
            "the grader cannot read what the submission's ranks sent: a check raised "
            f"{type(exc).__name__}: {str(exc)[:300]}{_grader_frame(exc)}"), file=os.path.basename(path))
        not_run = "the grading stopped before it (the problem above says why)"
    report.checks = g.results(not_run)
    report.sections = list(g.sections)
    report.world_sizes = sorted(g.sizes_run) or ([] if g.in_one_process else report.world_sizes)
    report.in_one_process = g.in_one_process and not g.sizes_run
    if report.run_problem is None:
        report.status = overall_status(report.checks)
    report.seconds = time.monotonic() - started
    return report


def _grader_frame(exc: BaseException) -> str:
    """" (grader/checks/ex03_train.py line 120)": the innermost frame of the grader's own code."""
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename).startswith(here)]
    if not frames:
        return ""
    last = frames[-1]
    return f" (grader/{os.path.relpath(last.filename, here)} line {last.lineno})"


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


def _guess(path: str, exercise_id: str | None) -> catalog.Exercise | None:
    if exercise_id:
        return catalog.by_id(exercise_id)
    return catalog.from_filename(path)
