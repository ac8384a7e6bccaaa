"""Render a :class:`~grader.results.Report` as text or JSON."""

from __future__ import annotations

import json

import click

from grader.results import ERROR, FAIL, PASS, PASSED, SKIP, TIMEOUT, UNUSABLE, Report

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
    return "\n".join(lines)


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
