"""Render a :class:`~grader.results.Report` as text, JSON or JUnit XML."""

from __future__ import annotations

import json

import click

from grader import results as R
from grader.rank.untrusted import clean_line, clean_text
from grader import timeline_view
from grader.timeline import is_timeline
from grader.rank.outcomes import describe_exit
from grader.results import (CLAIMED, ERROR, FAIL, FAILED, NOT_CHECKED, PASS, PASSED, SKIP, TIMEOUT, UNUSABLE, RankRecord,
                            Report, RunProblem)

_LABELS = {PASS: ("PASS", "green"), FAIL: ("FAIL", "red"), ERROR: ("----", "yellow"), SKIP: ("SKIP", "blue"),
           NOT_CHECKED: ("----", "yellow"), CLAIMED: ("CLAIM", "cyan")}
CLAIMED_WORDS = ("recorded by the submission's own processes about themselves: nothing the grader measured shows it, "
                 "so it is not counted here")


def render_text(report: Report, color: bool = False, verbose: bool = False) -> str:
    """The report a learner reads: one line per check, what was observed under each failure."""

    def style(text, **kw):
        return click.style(text, **kw) if color else text

    lines = []
    head = f"Exercise {report.exercise}: {report.title}" if report.exercise else "ddp-grade"
    lines.append(style(head, bold=True) + f"   {clean_line(report.path)}")
    if report.in_one_process:
        lines.append(f"in one process (world sizes simulated), {report.seconds:.1f} s")
    elif report.backend:
        sizes = ", ".join(str(s) for s in report.world_sizes) or "-"
        lines.append(f"{report.backend}, world size{'s' if len(report.world_sizes) > 1 else ''} {sizes}, "
                     f"{report.seconds:.1f} s")
    # Everything below may hold what a submission printed or raised: shown as text, never as terminal control.
    problem, details = clean_text(problem_of(report) or ""), clean_text(details_of(report))
    if problem:
        colour = "yellow" if report.status in (UNUSABLE, TIMEOUT) else "red"
        lines.append("")
        for i, line in enumerate(problem.splitlines()):
            lines.append(style(("  ! " if i == 0 else "    ") + line, fg=colour, bold=i == 0))
    if report.checks:
        lines.append("")
        width = max(len(c.id) for c in report.checks)
        label_width = max(len(_LABELS[c.status][0]) for c in report.checks)  # 5 only where a check is claimed
        failures = report.failures_by_cause()  # causes first, then what they explain, then the rest
        waiting = [c for c in report.checks if c.status == NOT_CHECKED]
        for c in failures + waiting + [c for c in report.checks if c.status not in (FAIL, NOT_CHECKED)]:
            label, colour = _LABELS[c.status]
            lines.append(f"  {style(label, fg=colour)}{' ' * (label_width - len(label))}  {c.id.ljust(width)}  {c.title}")
            if c.status == FAIL:
                for msg_line in clean_text(c.message).splitlines():
                    lines.append(f"        {msg_line}")
                if c.hint:
                    lines.append(style(f"        hint: {c.hint}", dim=True))
            elif c.status in (SKIP, NOT_CHECKED) and c.message:
                lines.append(style(f"        {clean_line(c.message)}", dim=True))
            elif c.status == ERROR and verbose:
                lines.append(style(f"        {clean_line(c.message)}", dim=True))
        if any(c.status == CLAIMED for c in report.checks):
            lines.append(style(f"  CLAIM: {CLAIMED_WORDS}.", dim=True))
    for section in report.sections:
        body = section["text"]
        if is_timeline(section):  # drawn under -v, or where the exercise's schedule is the point
            body = timeline_view.section_text(section, verbose, width=timeline_view.WIDTH - 2)
            if not body:
                continue
        lines.append("")
        lines.append(style(f"{clean_line(section['title'])}:", bold=True))
        lines.extend("  " + ln for ln in clean_text(body).splitlines())
    if details and (verbose or report.status == TIMEOUT or problem):
        lines.append("")
        lines.append(style("details:", bold=True))
        lines.extend("  " + ln for ln in details.splitlines())
    lines.append("")
    lines.append(_summary(report, style))
    pointer = hint_pointer(report)
    if pointer:
        lines.append(style(pointer, dim=True))
    return "\n".join(lines)


def hint_pointer(report: Report) -> str:
    """"Stuck on CHECK? `ddp-grade hint NN` ..." for a failed grading of a known exercise, else ""."""
    if not report.exercise or report.status == PASSED:
        return ""
    failing = [c.id for c in report.failures_by_cause()]
    if not failing and report.status != FAILED:
        return ""
    what = f"Stuck on {failing[0]}? " if failing else "Stuck? "
    return what + f"`ddp-grade hint {report.exercise}` shows hints in levels (a nudge, the API, the code's shape)."


def _summary(report: Report, style) -> str:
    counts = report.counts()
    graded = len(report.checks) - counts[SKIP] - counts[NOT_CHECKED]
    passed = counts[PASS] + counts[CLAIMED]
    waiting = ""
    if counts[NOT_CHECKED]:
        causes = sorted({c.likely_cause for c in report.checks if c.status == NOT_CHECKED and c.likely_cause})
        waiting = (f"; {counts[NOT_CHECKED]} not checked until {' and '.join(causes) or 'the failed checks'} "
                   f"{'pass' if len(causes) > 1 else 'passes'}")
    evidence = evidence_words(report)
    if report.status == PASSED:
        return style(f"All {graded} checks passed; {evidence}.", fg="green", bold=True)
    if report.status == UNUSABLE:
        return style("Could not grade this file (exit 2).", fg="yellow", bold=True)
    if report.status == TIMEOUT:
        return style(f"Timed out; {passed}/{graded} checks passed before that{waiting}; {evidence} (exit 3).",
                     fg="yellow", bold=True)
    if passed == graded and not counts[PASS] and not report.claims_count:
        return style(f"All {graded} checks passed on claims alone: none was decided on evidence, so the grading "
                     "shows nothing (exit 1).", fg="red", bold=True)
    return style(f"{passed}/{graded} checks passed{waiting}; {evidence} (exit 1).", fg="red", bold=True)


def evidence_words(report: Report) -> str:
    """"5 decided on evidence", and where claims count for nothing ", 3 claimed (not counted)"."""
    words = f"{report.decided_on_evidence} decided on evidence"
    claimed = report.counts()[CLAIMED]
    return words + (f", {claimed} claimed (not counted)" if claimed else "")


def problem_of(report: Report) -> str | None:
    """The run problem in words (None when there was none)."""
    return problem_text(report.run_problem) if report.run_problem else None


def details_of(report: Report) -> str:
    """Per-rank tracebacks, stacks and output that explain the run problem ("" when none)."""
    return rank_details(report.run_problem.ranks) if report.run_problem else ""


def json_dict(report: Report) -> dict:
    """The JSON report as a dict (docs/results-schema.md): the report's data and its prose fields."""
    data = report.to_dict()
    out = {}
    for key, value in data.items():  # the documented order: problem after exit_code, details after run_problem
        out[key] = value
        if key == "exit_code":
            out["problem"] = problem_of(report)
        elif key == "run_problem":
            out["details"] = details_of(report)
    return out


def render_json(report: Report) -> str:
    return json.dumps(json_dict(report), indent=2)


def render_junit(report: Report) -> str:
    """The report as JUnit XML (one ``testsuite``, one ``testcase`` per check), for CI dashboards.

    A failed check is a ``<failure>``, a check that could not be decided an ``<error>``, a skipped
    one ``<skipped>``. A file that could not be graded at all (no checks) is one ``grading`` test
    case with an ``<error>`` carrying the problem.
    """
    from xml.etree import ElementTree as ET

    counts = report.counts()
    # Everything below may hold what a submission printed or raised: shown as text, never as terminal control.
    problem, details = clean_text(problem_of(report) or ""), clean_text(details_of(report))
    name = f"ddp-grade.exercise-{report.exercise}" if report.exercise else "ddp-grade"
    classname = f"exercise{report.exercise}" if report.exercise else "ddp-grade"
    suite = ET.Element("testsuite", {
        "name": name,
        "tests": str(len(report.checks) or 1),
        "failures": str(counts[FAIL]),
        "errors": str(counts[ERROR] + (0 if report.checks else 1)),
        "skipped": str(counts[SKIP] + counts[NOT_CHECKED] + counts[CLAIMED]),
        "time": f"{report.seconds:.3f}",
    })
    props = ET.SubElement(suite, "properties")
    for key, value in (("path", report.path), ("status", report.status), ("backend", report.backend),
                       ("world_sizes", ",".join(str(s) for s in report.world_sizes)),
                       ("points", f"{report.points:g}"), ("max_points", f"{report.max_points:g}"),
                       ("decided_on_evidence", str(report.decided_on_evidence)),
                       ("claims_count", "true" if report.claims_count else "false")):
        ET.SubElement(props, "property", {"name": key, "value": _xml_text(value)})
    if not report.checks:
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": "grading", "time": "0"})
        err = ET.SubElement(case, "error", {"message": _xml_text((problem or report.status).splitlines()[0]),
                                            "type": report.status})
        err.text = _xml_text("\n".join(x for x in (problem or "", details) if x))
    for c in report.checks:
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": c.id, "time": f"{c.seconds:.3f}"})
        first = (c.message or c.title).splitlines()[0] if (c.message or c.title) else ""
        if c.status == FAIL:
            where = " ".join(x for x in (f"rank {c.rank}" if c.rank is not None else "",
                                          f"world size {c.world_size}" if c.world_size else "") if x)
            body = [c.title, c.message]
            if where:
                body.append(f"({where})")
            if c.hint:
                body.append(f"hint: {c.hint}")
            el = ET.SubElement(case, "failure", {"message": _xml_text(first), "type": "fail"})
            el.text = _xml_text("\n".join(x for x in body if x))
        elif c.status == ERROR:
            el = ET.SubElement(case, "error", {"message": _xml_text(first), "type": "error"})
            el.text = _xml_text(c.message)
        elif c.status in (SKIP, NOT_CHECKED):
            ET.SubElement(case, "skipped", {"message": _xml_text(c.message)})
        elif c.status == CLAIMED:
            ET.SubElement(case, "skipped", {"message": f"claimed: {CLAIMED_WORDS}"})
    if problem and report.checks:
        out = ET.SubElement(suite, "system-out")
        out.text = _xml_text("\n".join(x for x in (problem, details) if x))
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def _xml_text(text: str) -> str:
    """Drop the characters XML 1.0 cannot hold (a rank's output may contain any byte)."""
    return "".join(ch for ch in clean_text(text) if ch in "\t\n\r" or (ord(ch) >= 0x20 and ch not in "\ufffe\uffff"
                                                                  and not 0xD800 <= ord(ch) <= 0xDFFF))


# --- a run problem in words -------------------------------------------------------------------


def problem_text(p: RunProblem) -> str:
    """What stopped the grading, for a learner: the first line says it, later lines say where."""
    words = _PROBLEM_WORDS.get(p.kind, _raised)(p)
    if p.context:
        first, _, rest = words.partition("\n")
        words = f"{first} ({p.context})" + (f"\n{rest}" if rest else "")
    return words


def _ranks(numbers: list[int]) -> str:
    return ", ".join(f"rank {n}" for n in numbers)


def _subject(p: RunProblem) -> str:
    if p.evidence.get("single_process"):
        return "your code" if p.kind == R.RAISED else "the process running your code"
    return f"rank {p.rank}"


def _at(where, with_function: bool = True) -> str:
    """" (07_ring.py line 30, in ring_all_reduce: `dist.send(t, dst)`)": the learner's frame and its line."""
    if where is None:
        return ""
    code = f": `{where.code}`" if getattr(where, "code", "") else ""
    function = f", in {where.function}" if with_function and where.function else ""
    return f" ({where.file} line {where.line}{function}{code})"


def _raised(p: RunProblem) -> str:
    first = _rank_of(p)
    over = f": it went over {first.limit_detail}" if first is not None and first.limit else ""
    text = f"{_subject(p)} raised {p.exception}: {p.message}{_at(p.where)}{over}"
    return text + _aftermath(p)


def _exited(p: RunProblem) -> str:
    if p.kind == R.LIMIT and not p.exception:
        text = f"{_subject(p)} went over {p.evidence.get('limit_detail', 'a limit')} and was stopped"
    elif p.kind == R.LIMIT:
        return _raised(p)
    else:
        text = f"{_subject(p)} {describe_exit(p.evidence.get('exitcode'))} before it finished"
        if p.evidence.get("said"):
            text += f"; its last words: {p.evidence['said']}"
    return text + _aftermath(p)


def _aftermath(p: RunProblem) -> str:
    text = ""
    if p.kind == R.MISMATCHED_COLLECTIVE:
        text += (f"\n({_ranks(p.finished)} had already finished: rank {p.rank} was left in a collective the others "
                 "never called. Do all ranks make the same collective calls in the same order?)")
    if p.stopped:
        text += f"; {_ranks(p.stopped)} could not finish without it and " + \
            ("was" if len(p.stopped) == 1 else "were") + " stopped"
    return text


def _rank_of(p: RunProblem) -> RankRecord | None:
    return next((r for r in p.ranks if r.rank == p.rank), p.ranks[0] if p.ranks else None)


def _timeout(p: RunProblem) -> str:
    if p.evidence.get("single_process"):
        record = p.ranks[0] if p.ranks else None
        return (f"timed out after {p.timeout_s:g} s: the call to the learner's code did not return "
                f"(an endless loop?){_location(record) if record else ''}")
    stuck = [r for r in p.ranks if r.rank in p.stopped]
    waits = p.evidence.get("waiting_in") or {}
    lines = [f"timed out after {p.timeout_s:g} s: " + (_ranks(p.stopped) or "no rank")
             + (" was" if len(stuck) == 1 else " were") + f" still running ({_STUCK_WHY.get(p.kind, _STUCK_WHY[R.TIMEOUT_KIND])})"]
    for r in stuck:
        waiting = waits.get(str(r.rank), "")
        what = f" (waiting in {waiting})" if waiting and waiting not in ("code", "debugger") and \
            not r.inside.startswith(waiting + " ") else ""
        lines.append(f"  rank {r.rank}{_location(r) or ': no stack was captured'}{what}")
    for r in p.ranks:
        if r.status in ("error", "exited"):
            lines.append(f"  {rank_line(r)}")
    advice = _STUCK_ADVICE.get(p.kind)
    if advice:
        lines.append(advice(p) if callable(advice) else advice)
    return "\n".join(lines)


_STUCK_WHY = {
    R.TIMEOUT_KIND: "a deadlock or an endless loop?",
    R.STUCK_RENDEZVOUS: "stuck in rendezvous: init_process_group waits for peers that never came",
    R.STUCK_COLLECTIVE: "stuck in a collective that the other ranks do not call",
    R.STUCK_SEND_RECV: "stuck in blocking send/recv calls that wait for each other",
    R.STUCK_DEBUGGER: "stopped at a debugger prompt",
    R.STUCK_LEARNER_LOOP: "still running your code: an endless loop?",
}


def _collective_advice(p: RunProblem) -> str:
    text = "Every rank must make the same collective calls in the same order"
    if p.finished:
        text += f"; {_ranks(p.finished)} had already finished, so a collective only some ranks call waits for ever"
    return "  " + text + "."


_STUCK_ADVICE = {
    R.STUCK_SEND_RECV: "  A blocking send waits until the peer receives: if two ranks both send first, neither "
                       "gets to recv. Alternate the order by rank, or use isend/irecv and wait.",
    R.STUCK_COLLECTIVE: _collective_advice,
    R.STUCK_RENDEZVOUS: lambda p: _rendezvous_advice(p),
    R.STUCK_DEBUGGER: "  The grader gives ranks no terminal: remove breakpoint() / pdb.set_trace() before grading.",
}


def _debugger(p: RunProblem) -> str:
    where = f" at {p.where.file} line {p.where.line}, in {p.where.function}" if p.where else ""
    return (f"{_subject(p)} stopped at a debugger prompt{where} (breakpoint() or pdb.set_trace()): ranks have "
            "no terminal, so the debugger read end-of-input and quit (BdbQuit)" + _aftermath(p)
            + ".\nRemove the breakpoint before grading.")


def _rendezvous_advice(p: RunProblem) -> str:
    waits = p.evidence.get("waiting_in") or {}
    absent = [int(rank) for rank, what in waits.items() if what != "rendezvous"]
    text = "  Every rank must call init_process_group, with the same address and port"
    if absent:
        text += f"; {_ranks(sorted(absent))} never got there"
    if p.finished:
        text += f"; {_ranks(p.finished)} had already finished"
    return text + "."


def _rendezvous(p: RunProblem) -> str:
    e = p.evidence
    where = f" ({p.where.file} line {p.where.line}, in {p.where.function})" if p.where else ""
    if e.get("source") == "init_method":
        fix = ("Build init_method from MASTER_ADDR and MASTER_PORT in the environment (or leave it out: env:// "
               "is the default), so that every launcher can choose the port.")
    else:
        fix = ("Set MASTER_ADDR and MASTER_PORT only when they are missing (os.environ.setdefault), "
               "never overwrite them: the launcher chooses the port.")
    waited = e.get("waited_s", 0)  # the rank's own word: shown as it is when it is no number
    waited = f"{waited:g}" if type(waited) in (int, float) else str(waited)
    return (f"{_subject(p)} waited {waited} s in init_process_group for its peers at "
            f"{e.get('addr')}:{e.get('port')}{where}, but the rendezvous is at MASTER_ADDR={e.get('grader_addr')} "
            f"MASTER_PORT={e.get('grader_port')}: the ranks never meet there.\n{fix}") + _aftermath(p)


def _location(r: RankRecord) -> str:
    """", at 03_train.py line 14 in setup_ddp, inside all_reduce (torch/...)" from a rank's stack."""
    parts = []
    if r.where is not None and r.stack:
        code = f" (`{r.where.code}`)" if getattr(r.where, "code", "") else ""
        parts.append(f"at {r.where.file} line {r.where.line} in {r.where.function}{code}")
    if r.inside:
        parts.append(f"inside {r.inside}")
    return ": " + ", ".join(parts) if parts else ""


_PROBLEM_WORDS = {
    R.UNUSABLE_FILE: lambda p: p.message,
    R.BAD_OPTION: lambda p: p.message,
    R.CHECK_STOPPED: lambda p: p.message,
    R.GRADER_ERROR: lambda p: (f"the grader failed on this file: {p.exception}: {p.message}" if p.exception
                               else p.message),
    R.IMPORT_ERROR: lambda p: f"importing {p.file} failed: {p.exception}: {p.message}{_at(p.where, False)}",
    R.MISSING_NAME: lambda p: f"{p.file} does not define {p.name}",
    R.NOT_IMPLEMENTED: lambda p: f"not implemented yet: {p.name}",
    R.UNREADABLE: lambda p: p.message,
    R.STOPPED: lambda p: "a rank was stopped before it finished",
    R.RAISED: _raised,
    R.MISMATCHED_COLLECTIVE: _raised,
    R.EXITED: _exited,
    R.LIMIT: _exited,
    R.TIMEOUT_KIND: _timeout,
    R.STUCK_COLLECTIVE: _timeout,
    R.STUCK_SEND_RECV: _timeout,
    R.STUCK_DEBUGGER: lambda p: _timeout(p) if p.timeout_s is not None else _debugger(p),
    R.STUCK_LEARNER_LOOP: _timeout,
    R.STUCK_RENDEZVOUS: lambda p: _timeout(p) if p.timeout_s is not None else _rendezvous(p),
}


def rank_line(r: RankRecord) -> str:
    """One line for a learner: what went wrong in this rank."""
    if r.status == "ok":
        return f"rank {r.rank} finished"
    if r.status == "error":
        over = f": it went over {r.limit_detail}" if r.limit else ""
        return f"rank {r.rank} raised {r.exception}: {r.message}{_at(r.where)}{over}"
    if r.limit:
        return f"rank {r.rank} went over {r.limit_detail} and was stopped"
    if r.status == "exited":
        return f"rank {r.rank} {describe_exit(r.exitcode)} before it finished"
    if r.lost_peer:
        return f"rank {r.rank} lost a peer that had failed and was stopped"
    return f"rank {r.rank} was still running and was stopped"


def rank_details(ranks: list[RankRecord]) -> str:
    """Per-rank tracebacks, stacks and output tails, for the report's details."""
    parts = []
    for r in ranks:
        chunk = []
        if r.traceback:
            chunk.append(r.traceback)
        if r.stack:
            chunk.append("stack when stopped:\n" + r.stack)
        if r.output:
            chunk.append("output (last lines):\n" + r.output)
        if chunk:
            parts.append(f"--- rank {r.rank} ({r.status}) ---\n" + "\n".join(chunk))
    return "\n".join(parts)
