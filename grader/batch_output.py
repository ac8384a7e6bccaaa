"""What ``ddp-grade batch`` (and ``batch merge``) write: a table, JSON, CSV, Markdown, JUnit XML.

Every format is made from the same list of outcomes, one per submission, each holding the
submission's full report as ``Report.to_dict()`` gives it; the JSON output holds them all and
can be read back (:func:`read_json`), which is what ``batch merge`` does with shards' outputs.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field

from grader.results import EXIT_CODES, FAILED, PASSED, TIMEOUT, UNUSABLE
from grader.rank.untrusted import clean_line

SEVERITY = [PASSED, FAILED, TIMEOUT, UNUSABLE]  # worst last
ROW_FIELDS = ["submission", "file", "exercise", "status", "exit_code", "check", "check_status", "message",
              "points", "seconds"]
SCHEMA = 1  # of the batch JSON; fields may be added (e.g. "shard"), none removed


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


def worst_status(outcomes: list[Outcome]) -> str:
    return max((o.status for o in outcomes), key=SEVERITY.index, default=PASSED)


def tally(outcomes: list[Outcome]) -> dict:
    return {s: sum(1 for o in outcomes if o.status == s) for s in SEVERITY}


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


def _summary_cells(o: Outcome) -> tuple[str, str, str, str, str, str]:
    """submission, exercise, status, checks passed, seconds, the problem (or the failed checks)."""
    r = o.report
    counts = r.get("counts") or {}
    claimed = counts.get("claimed", 0)  # passed on a claim alone: shown, not counted
    graded = sum(counts.values()) - counts.get("skip", 0) - claimed
    checks = f"{counts.get('pass', 0)}/{graded}" + (f" +{claimed} claimed" if claimed else "") if r.get("checks") else "-"
    problem = (r.get("problem") or "").splitlines()[0] if r.get("problem") else ""
    if not problem and o.status == FAILED:
        failed = [c["id"] for c in r.get("checks", []) if c["status"] == "fail"]
        problem = "failed: " + ", ".join(failed) if failed else "failed: no check was decided on evidence"
    return (clean_line(o.submission.name), clean_line(r.get("exercise") or "-"), o.status, checks,
            f"{r.get('seconds', 0.0):.1f}", clean_line(problem))


def totals_line(outcomes: list[Outcome]) -> str:
    t = tally(outcomes)
    worst = worst_status(outcomes)
    return (f"{len(outcomes)} submission{'s' if len(outcomes) != 1 else ''}: {t[PASSED]} passed, "
            f"{t[FAILED]} failed, {t[TIMEOUT]} timed out, {t[UNUSABLE]} could not be graded "
            f"(exit {EXIT_CODES[worst]}).")


def render_table(outcomes: list[Outcome]) -> str:
    """The summary: one line per submission, then the totals."""
    head = ("submission", "ex", "status", "checks", "seconds", "problem")
    lines = [(*cells[:-1], _clip(cells[-1], 70)) for cells in map(_summary_cells, outcomes)]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)] if lines else [len(h) for h in head]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    text = [fmt.format(*head), fmt.format(*("-" * w for w in widths[:-1]), "-" * len(head[-1]))]
    text += [fmt.format(*line) for line in lines]
    text.append("")
    text.append(totals_line(outcomes))
    return "\n".join(text)


def render_markdown(outcomes: list[Outcome]) -> str:
    """The summary as a Markdown table, e.g. for a CI job's summary page."""
    out = ["| submission | exercise | status | checks | seconds | problem |", "|---|---|---|---|---|---|"]
    for cells in map(_summary_cells, outcomes):
        out.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    out += ["", totals_line(outcomes)]
    return "\n".join(out) + "\n"


def _md_cell(text: str) -> str:
    return _clip(str(text), 120).replace("|", "\\|").replace("\n", " ") or " "


def render_json(outcomes: list[Outcome], shard: dict | None = None) -> str:
    """Every row and every full report; ``shard`` (index, count, the whole batch's names) when split."""
    worst = worst_status(outcomes)
    data = {
        "schema": SCHEMA,
        "exit_code": EXIT_CODES[worst],
        "status": worst,
        "rows": rows(outcomes),
        "reports": [{"submission": o.submission.name, "file": o.submission.path, **o.report} for o in outcomes],
    }
    if shard is not None:
        data["shard"] = shard
    return json.dumps(data, indent=2)


def render_csv(outcomes: list[Outcome]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=ROW_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows(outcomes):
        writer.writerow({**row, "message": row["message"].replace("\n", " | ")})
    return buffer.getvalue()


def render_junit(outcomes: list[Outcome]) -> str:
    """JUnit XML: one ``testsuite`` per submission (as ``ddp-grade grade --junit`` writes it), in a ``testsuites``."""
    from xml.etree import ElementTree as ET

    from grader.report import render_junit as report_junit
    from grader.results import report_from_dict

    suites = ET.Element("testsuites", {"name": "ddp-grade batch"})
    for o in outcomes:
        suite = ET.fromstring(report_junit(report_from_dict(_report_fields(o))))
        suite.set("name", f"{o.submission.name}")
        suites.append(suite)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def _report_fields(o: Outcome) -> dict:
    r = o.report
    return {"exercise": r.get("exercise", ""), "title": r.get("title", ""), "path": r.get("path", o.submission.path),
            "status": o.status, **{k: r[k] for k in ("checks", "run_problem", "backend", "world_sizes", "seconds",
                                                     "in_one_process") if k in r}}


def read_json(text: str) -> tuple[list[Outcome], dict | None]:
    """The outcomes (and the ``shard`` field, if any) of a JSON output; ValueError when it is not one."""
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("reports"), list):
        raise ValueError("it is not the JSON output of `ddp-grade batch`")
    outcomes = []
    for r in data["reports"]:
        if not isinstance(r, dict) or not isinstance(r.get("submission"), str):
            raise ValueError("a report in it has no submission name")
        report = {k: v for k, v in r.items() if k not in ("submission", "file")}
        outcomes.append(Outcome(Submission(r["submission"], r.get("file") or r.get("path") or r["submission"]),
                                report))
    shard = data.get("shard")
    return outcomes, shard if isinstance(shard, dict) else None


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
