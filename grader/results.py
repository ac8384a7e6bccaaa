"""Check results and grading reports as plain data, separate from how they are shown."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from grader.catalog import CLAIM, ON_EVIDENCE
from grader.exits import EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, EXIT_UNUSABLE

PASS = "pass"
FAIL = "fail"
ERROR = "error"  # the check could not be evaluated (not run, or the grader could not decide)
SKIP = "skip"  # does not apply here (e.g. an NCCL-only check on gloo)
NOT_CHECKED = "not-checked"  # not decided because a check it depends on failed (which one: ``likely_cause``)
CLAIMED = "claimed"  # passed on what the submission's own processes recorded alone, where claims count for nothing
# (under --sandbox, in batch, on Gradescope: see count_evidence_only)

# Overall statuses and their exit codes.
PASSED = "passed"
FAILED = "failed"
UNUSABLE = "unusable"  # the file could not be graded
TIMEOUT = "timeout"
SCHEMA = 4  # of Report.to_dict(): 2 added run_problem; 3 the check status not-checked; 4 each check's evidence,
# the check status claimed and the report's evidence

EXIT_CODES = {PASSED: EXIT_OK, FAILED: EXIT_FAILED, UNUSABLE: EXIT_UNUSABLE, TIMEOUT: EXIT_TIMEOUT}


PLAIN_DEPTH = 32  # levels of a value kept in a report; deeper ones are shown as text
PLAIN_TEXT = 2000  # characters of a value shown as text


def plain(value, depth: int = 0):
    """``value`` as JSON's data (text, finite numbers, true/false, null, lists, objects with text keys),
    whatever a submission's ranks put in it: bytes, sets and anything else as text (their ``repr``, cut),
    tuples as lists, a NaN, an infinity or an integer past 64 bits as text, what nests deeper than
    :data:`PLAIN_DEPTH` as text. Subclasses of text and numbers become the plain kind (their own methods
    never run)."""
    if value is None or type(value) is bool:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int) and not isinstance(value, bool):
        number = int.__int__(value)
        return number if -2**63 <= number < 2**64 else f"<an integer of {number.bit_length()} bits>"
    if isinstance(value, float):
        number = float.__float__(value)
        return number if math.isfinite(number) else repr(number)
    if depth < PLAIN_DEPTH:
        if type(value) is dict:
            return {plain(key, PLAIN_DEPTH) if isinstance(key, str) else _as_text(key): plain(item, depth + 1)
                    for key, item in value.items()}
        if type(value) in (list, tuple):
            return [plain(item, depth + 1) for item in value]
    return _as_text(value)


def _as_text(value) -> str:
    """A value that is not JSON's as text: a set's members in a stable order, bytes as Python writes them,
    anything else by its kind."""
    if isinstance(value, (set, frozenset)):
        members = sorted(_member(v) for v in list(value)[:1000])
        text = "{" + ", ".join(members) + "}"
    elif isinstance(value, (bytes, bytearray)):
        text = repr(bytes(value[:PLAIN_TEXT]))
    elif isinstance(value, (str, int, float)) or value is None:
        text = repr(value)
    else:
        text = f"<{type(value).__name__}>"  # its own __repr__ is the submission's code
    return text if len(text) <= PLAIN_TEXT else text[:PLAIN_TEXT] + "..."


def _member(value) -> str:
    if isinstance(value, str):
        return repr(str.__str__(value))
    shown = plain(value, PLAIN_DEPTH)  # a number, or text already
    return shown if isinstance(shown, str) else repr(shown)


@dataclass
class CheckResult:
    """The verdict of one check."""

    id: str  # stable check id
    title: str  # what the check establishes
    status: str  # pass, fail, error, skip or not-checked
    message: str = ""  # what was observed, in terms a learner acts on
    rank: int | None = None  # the rank that shows the problem, when one does
    world_size: int | None = None  # the world size of the run that shows it
    seconds: float = 0.0  # time spent deciding it (including its runs)
    points: float = 1.0  # weight in the score
    hint: str = ""  # what to look at when it fails (empty for the debugging track: the report never gives the fix)
    likely_cause: str | None = None  # another failed check that explains this failure (or kept this one from
    # being decided, for not-checked): fix that one first
    evidence: str = CLAIM  # what the verdict stands on: value, kernel or claim (the catalog's, grader.catalog)

    def to_dict(self) -> dict:
        return asdict(self)


# Kinds of run problem (RunProblem.kind): what stopped a grading before every check was decided.
UNUSABLE_FILE = "unusable-file"  # the file could not be read or parsed, or holds another exercise
IMPORT_ERROR = "import-error"  # importing the learner's file raised
MISSING_NAME = "missing-name"  # the file does not define a name the grader imports
NOT_IMPLEMENTED = "not-implemented"  # a function still raises NotImplementedError
RAISED = "raised"  # a rank (or the worker) raised an exception
EXITED = "exited"  # a rank ended without a result: an exit code or a signal
LIMIT = "limit"  # a rank went over the memory, CPU or output limit
STOPPED = "stopped"  # a rank was stopped although none failed (cannot happen alone)
MISMATCHED_COLLECTIVE = "mismatched-collective"  # a rank was left in a collective the others never called
TIMEOUT_KIND = "timeout"  # ranks were still running at the deadline
STUCK_RENDEZVOUS = "stuck-in-rendezvous"  # ranks never met: init_process_group waited for peers
STUCK_COLLECTIVE = "stuck-in-collective"  # ranks wait in collectives that do not match
STUCK_SEND_RECV = "stuck-in-send-recv"  # ranks wait in blocking point-to-point calls
STUCK_DEBUGGER = "stuck-in-debugger"  # a rank waits at a debugger prompt (breakpoint, pdb)
STUCK_LEARNER_LOOP = "stuck-in-learner-code"  # a rank runs the learner's own code (a loop?)
CHECK_STOPPED = "check-stopped"  # an exercise's checks stopped the grading, with a message
BAD_OPTION = "bad-option"  # the options cannot work here (e.g. nccl without GPUs)
GRADER_ERROR = "grader-error"  # the grader itself failed on this file
UNREADABLE = "unreadable"  # the submission's processes sent what the grader cannot read, or broke its sandbox


@dataclass
class Location:
    """A place in the learner's file."""

    file: str
    line: int
    function: str
    code: str = ""  # the text of that line


@dataclass
class RankRecord:
    """What one rank of a failed run did, as data."""

    rank: int
    status: str  # ok, error (raised), exited (ended without a result), killed (stopped by the grader)
    exception: str = ""  # the exception's type, when it raised
    message: str = ""  # the exception's message
    where: Location | None = None  # where in the learner's file it raised or was stopped
    inside: str = ""  # the innermost function it was in when stopped, e.g. "all_reduce (torch/...)"
    exitcode: int | None = None  # its exit code (negative: killed by that signal)
    limit: str = ""  # memory, cpu or output, when it went over that limit
    limit_detail: str = ""  # "the memory limit (2048 MiB resident; --memory-limit changes it)"
    lost_peer: bool = False  # it was stopped after a peer failed, with an error of its own
    seconds: float = 0.0  # how long it ran
    traceback: str = ""  # the traceback, the grader's own frames dropped
    stack: str = ""  # its stack when stopped, the process plumbing dropped
    output: str = ""  # the last lines it printed


@dataclass
class RunProblem:
    """Why a grading stopped before every check was decided: plain data, rendered by the report."""

    kind: str  # one of the kinds above
    status: str  # the grading's status: failed, unusable or timeout
    rank: int | None = None  # the rank that shows the cause first
    world_size: int | None = None  # of the run that shows it
    name: str = ""  # missing-name / not-implemented: the name; check-stopped: the check module's words
    exception: str = ""  # raised / import-error: the exception type
    message: str = ""  # the exception's message, or the words for unusable-file / check-stopped / bad-option
    where: Location | None = None  # where in the learner's file
    timeout_s: float | None = None  # timeout kinds: the deadline that passed
    context: str = ""  # what the grader was doing, e.g. "shard_indices(num_samples=0, ...)"
    finished: list[int] = field(default_factory=list)  # ranks that had finished when the cause struck
    stopped: list[int] = field(default_factory=list)  # ranks stopped because of it
    file: str = ""  # the learner's file name, as the messages show it
    evidence: dict = field(default_factory=dict)  # kind-specific facts (e.g. the rendezvous address)
    ranks: list[RankRecord] = field(default_factory=list)  # every rank of that run

    def __post_init__(self) -> None:
        self.evidence = plain(self.evidence) if isinstance(self.evidence, dict) else {}  # often a rank's words

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Report:
    """Everything one grading of one file found."""

    exercise: str  # "03"
    title: str
    path: str
    status: str  # passed, failed, unusable or timeout
    checks: list[CheckResult] = field(default_factory=list)
    run_problem: RunProblem | None = None  # why the grading stopped early, if it did
    backend: str = ""
    world_sizes: list[int] = field(default_factory=list)  # of the process groups that ran
    seconds: float = 0.0
    in_one_process: bool = False  # the learner's code ran in one worker process, not in a group
    sections: list[dict] = field(default_factory=list)  # what the grading observed beyond verdicts (see Grading.section)
    claims_count: bool = True  # False where a claim counts for nothing (count_evidence_only): its pass is claimed

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    @property
    def points(self) -> float:
        """The points of the checks that passed; where claims count for nothing (count_evidence_only), less
        the points of each check that failed on a claim (never below 0): a submission's records can say a check
        passed, never that it failed, so a failed claim is believed and a passed one earns nothing."""
        earned = sum(c.points for c in self.checks if c.status == PASS)
        if self.claims_count:
            return earned
        lost = sum(c.points for c in self.checks if c.status == FAIL and c.evidence not in ON_EVIDENCE)
        return max(0.0, earned - lost)

    @property
    def max_points(self) -> float:
        """The points of every check that counts: not skipped; where claims count for nothing, none that stands
        on a claim, whatever its verdict (so that every submission is scored on the same scale)."""
        return sum(c.points for c in self.checks
                   if c.status != SKIP and (self.claims_count or c.evidence in ON_EVIDENCE))

    @property
    def decided_on_evidence(self) -> int:
        """How many checks passed or failed on evidence: a value or what the kernel saw, not a claim."""
        return sum(1 for c in self.checks if c.status in (PASS, FAIL) and c.evidence in ON_EVIDENCE)

    def failures_by_cause(self) -> list[CheckResult]:
        """Failed checks, causes first: a failure explained by another failed check comes after it."""
        failed = [c for c in self.checks if c.status == FAIL]
        return [c for c in failed if not c.likely_cause] + [c for c in failed if c.likely_cause]

    def counts(self) -> dict:
        out = {PASS: 0, FAIL: 0, ERROR: 0, SKIP: 0, NOT_CHECKED: 0, CLAIMED: 0}
        for c in self.checks:
            out[c.status] += 1
        return out

    def to_dict(self) -> dict:
        """The report as plain data: what travels between processes (the grading protocol) and what the
        JSON report is made of; :func:`grader.report.render_json` adds the prose fields (``problem``,
        ``details``) documented in docs/results-schema.md. Every value is JSON's (:func:`plain`): a rank's
        bytes or sets in a problem's evidence or a section's data are text by then."""
        return plain({
            "schema": SCHEMA,
            "exercise": self.exercise,
            "title": self.title,
            "path": self.path,
            "status": self.status,
            "exit_code": self.exit_code,
            "run_problem": self.run_problem.to_dict() if self.run_problem else None,
            "backend": self.backend,
            "world_sizes": list(self.world_sizes),
            "in_one_process": self.in_one_process,
            "seconds": round(self.seconds, 3),
            "score": {"points": self.points, "max_points": self.max_points},
            "counts": self.counts(),
            "evidence": {"claims_count": self.claims_count, "decided": self.decided_on_evidence,
                         "claimed": self.counts()[CLAIMED]},
            "checks": [c.to_dict() for c in self.checks],
            "sections": [dict(s) for s in self.sections],
        })


REPORT_STATUSES = (PASSED, FAILED, UNUSABLE, TIMEOUT)
CHECK_STATUSES = (PASS, FAIL, ERROR, SKIP, NOT_CHECKED, CLAIMED)
EVIDENCE_KINDS = (*ON_EVIDENCE, CLAIM)


def report_from_dict(data: dict) -> Report:
    """The :class:`Report` that ``Report.to_dict()`` gave (e.g. sent by the grading server); ValueError
    when ``data`` is not one (an unknown status, a field of the wrong kind)."""
    try:
        report = _report_from_dict(data)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a report: {type(exc).__name__}: {exc}") from None
    if report.status not in REPORT_STATUSES:
        raise ValueError(f"not a report: the status {str(report.status)[:40]!r}")
    for check in report.checks:
        if check.status not in CHECK_STATUSES or not isinstance(check.id, str):
            raise ValueError(f"not a report: a check with the status {str(check.status)[:40]!r}")
        if check.evidence not in EVIDENCE_KINDS:
            raise ValueError(f"not a report: a check whose evidence is {str(check.evidence)[:40]!r}")
    if report.run_problem is not None and report.run_problem.status not in REPORT_STATUSES:
        raise ValueError("not a report: a run problem with an unknown status")
    for text in (report.exercise, report.title, report.path):
        if not isinstance(text, str):
            raise ValueError("not a report: a name that is not text")
    return report


def _report_from_dict(data: dict) -> Report:
    problem = data.get("run_problem")
    if problem is not None:
        ranks = [RankRecord(**{**r, "where": Location(**r["where"]) if r.get("where") else None})
                 for r in problem.get("ranks", [])]
        where = Location(**problem["where"]) if problem.get("where") else None
        problem = RunProblem(**{**problem, "ranks": ranks, "where": where})
    checks = [CheckResult(**c) for c in data.get("checks", [])]
    evidence = data.get("evidence") or {}
    return Report(data["exercise"], data["title"], data["path"], data["status"], checks, problem,
                  data.get("backend", ""), list(data.get("world_sizes", [])), float(data.get("seconds", 0.0)),
                  bool(data.get("in_one_process", False)), [dict(s) for s in data.get("sections", [])],
                  bool(evidence.get("claims_count", True)))


def overall_status(checks: list[CheckResult], claims_count: bool = True) -> str:
    """passed when no check failed or errored; where claims count for nothing, also only when some check
    passed on evidence (a grading that passed on claims alone has shown nothing)."""
    if not all(c.status in (PASS, SKIP, CLAIMED) for c in checks):
        return FAILED
    return PASSED if claims_count or any(c.status == PASS for c in checks) else FAILED


def count_evidence_only(report: Report) -> Report:
    """``report`` where a claim counts for nothing (under --sandbox, in batch, on Gradescope): each check that
    passed on a claim alone is claimed (shown, not counted), no check that stands on a claim weighs anything in
    the maximum score, and the grading passes only when every check passed and some check passed on evidence.
    Failures stay what they are, and a failed claim costs its points (Report.points): a submission's record of
    its own mistake is believed. Changes ``report`` in place and returns it."""
    if not report.claims_count:
        return report
    report.claims_count = False
    for check in report.checks:
        if check.status == PASS and check.evidence not in ON_EVIDENCE:
            check.status = CLAIMED
    if report.run_problem is None and report.checks and report.status in (PASSED, FAILED):
        report.status = overall_status(report.checks, claims_count=False)
    return report
