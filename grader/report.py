"""Render a :class:`~grader.results.Report` as text, JSON or JUnit XML."""

from __future__ import annotations

import json

import click

from grader.results import ERROR, FAIL, FAILED, PASS, PASSED, SKIP, TIMEOUT, UNUSABLE, Report

_LABELS = {PASS: ("PASS", "green"), FAIL: ("FAIL", "red"), ERROR: ("----", "yellow"), SKIP: ("SKIP", "blue")}


def render_text(report: Report, color: bool = False, verbose: bool = False) -> str:
    """The report a learner reads: one line per check, what was observed under each failure."""

    def style(text, **kw):
        return click.style(text, **kw) if color else text

    lines = []
    head = f"Exercise {report.exercise}: {report.title}" if report.exercise else "ddp-grade"
    lines.append(style(head, bold=True) + f"   {report.path}")
    if report.backend:
        sizes = ", ".join(str(s) for s in report.world_sizes)
        lines.append(f"{report.backend}, world size{'s' if len(report.world_sizes) > 1 else ''} {sizes}, "
                     f"{report.seconds:.1f} s")
    if report.problem:
        colour = "yellow" if report.status in (UNUSABLE, TIMEOUT) else "red"
        lines.append("")
        for i, line in enumerate(report.problem.splitlines()):
            lines.append(style(("  ! " if i == 0 else "    ") + line, fg=colour, bold=i == 0))
    if report.checks:
        lines.append("")
        width = max(len(c.id) for c in report.checks)
        for c in report.checks:
            label, colour = _LABELS[c.status]
            lines.append(f"  {style(label, fg=colour)}  {c.id.ljust(width)}  {c.title}")
            if c.status == FAIL:
                for msg_line in c.message.splitlines():
                    lines.append(f"        {msg_line}")
                if c.hint:
                    lines.append(style(f"        hint: {c.hint}", dim=True))
            elif c.status == SKIP and c.message:
                lines.append(style(f"        {c.message}", dim=True))
            elif c.status == ERROR and verbose:
                lines.append(style(f"        {c.message}", dim=True))
    if report.details and (verbose or report.status == TIMEOUT or report.problem):
        lines.append("")
        lines.append(style("details:", bold=True))
        lines.extend("  " + ln for ln in report.details.splitlines())
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
    failing = [c.id for c in report.checks if c.status == FAIL]
    if not failing and report.status != FAILED:
        return ""
    what = f"Stuck on {failing[0]}? " if failing else "Stuck? "
    return what + f"`ddp-grade hint {report.exercise}` shows hints in levels (a nudge, the API, the code's shape)."


def _summary(report: Report, style) -> str:
    counts = report.counts()
    graded = len(report.checks) - counts[SKIP]
    if report.status == PASSED:
        return style(f"All {graded} checks passed.", fg="green", bold=True)
    if report.status == UNUSABLE:
        return style("Could not grade this file (exit 2).", fg="yellow", bold=True)
    if report.status == TIMEOUT:
        return style(f"Timed out; {counts[PASS]}/{graded} checks passed before that (exit 3).", fg="yellow", bold=True)
    return style(f"{counts[PASS]}/{graded} checks passed (exit 1).", fg="red", bold=True)


def render_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2)


def render_junit(report: Report) -> str:
    """The report as JUnit XML (one ``testsuite``, one ``testcase`` per check), for CI dashboards.

    A failed check is a ``<failure>``, a check that could not be decided an ``<error>``, a skipped
    one ``<skipped>``. A file that could not be graded at all (no checks) is one ``grading`` test
    case with an ``<error>`` carrying the problem.
    """
    from xml.etree import ElementTree as ET

    counts = report.counts()
    name = f"ddp-grade.exercise-{report.exercise}" if report.exercise else "ddp-grade"
    classname = f"exercise{report.exercise}" if report.exercise else "ddp-grade"
    suite = ET.Element("testsuite", {
        "name": name,
        "tests": str(len(report.checks) or 1),
        "failures": str(counts[FAIL]),
        "errors": str(counts[ERROR] + (0 if report.checks else 1)),
        "skipped": str(counts[SKIP]),
        "time": f"{report.seconds:.3f}",
    })
    props = ET.SubElement(suite, "properties")
    for key, value in (("path", report.path), ("status", report.status), ("backend", report.backend),
                       ("world_sizes", ",".join(str(s) for s in report.world_sizes)),
                       ("points", f"{report.points:g}"), ("max_points", f"{report.max_points:g}")):
        ET.SubElement(props, "property", {"name": key, "value": _xml_text(value)})
    if not report.checks:
        case = ET.SubElement(suite, "testcase", {"classname": classname, "name": "grading", "time": "0"})
        err = ET.SubElement(case, "error", {"message": _xml_text((report.problem or report.status).splitlines()[0]),
                                            "type": report.status})
        err.text = _xml_text("\n".join(x for x in (report.problem or "", report.details) if x))
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
        elif c.status == SKIP:
            ET.SubElement(case, "skipped", {"message": _xml_text(c.message)})
    if report.problem and report.checks:
        out = ET.SubElement(suite, "system-out")
        out.text = _xml_text("\n".join(x for x in (report.problem, report.details) if x))
    ET.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


def _xml_text(text: str) -> str:
    """Drop the characters XML 1.0 cannot hold (a rank's output may contain any byte)."""
    return "".join(ch for ch in str(text) if ch in "\t\n\r" or (ord(ch) >= 0x20 and ch not in "\ufffe\uffff"
                                                                  and not 0xD800 <= ord(ch) <= 0xDFFF))
