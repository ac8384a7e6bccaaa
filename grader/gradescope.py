"""Gradescope: ``ddp-grade gradescope build`` writes an autograder bundle, ``gradescope run`` is what it runs.

Gradescope unzips the bundle into ``/autograder/source``, runs ``setup.sh`` once while it builds
the image, then ``run_autograder`` for each submission, with the student's files in
``/autograder/submission``; it reads ``/autograder/results/results.json`` back. The bundle:

    setup.sh         Python, CPU torch (pinned) and the kit, in /autograder/venv
    run_autograder   `python -m grader gradescope run`: grade, write results.json
    ddp-grade.json   what to grade: exercises, timeout, world size, sandbox, visibility
    kit/             the grader package and a pyproject.toml to install it (no solutions, no tests)

``results.json`` follows Gradescope's documented format: one test per check of each exercise
(name, score, max_score, status, output, visibility), the score from the catalog's points. A check that
stands on a claim (what the submission's own processes recorded about themselves) earns nothing when it
passes, and when it fails costs its points from its exercise's (never below 0): a submission can make its
records say a check passed, never that it failed. The results' top-level ``score``, which Gradescope takes
over the sum of the tests', is the sum of the exercises' scores so counted. A
submission that fails, crashes or hangs is a result (exit 0, every check it did not pass at 0
points); only a broken autograder (no results written) is an autograder failure. Paths come
from ``--root`` (``AUTOGRADER_ROOT`` in the scripts), so the bundle can be run anywhere.
"""

from __future__ import annotations

import json
import os
import stat
import time
import zipfile
from pathlib import Path

from grader import catalog
from grader.exits import EXIT_OK, EXIT_UNUSABLE
from grader.options import DEFAULT_TIMEOUT_S, GradeOptions

CONFIG = "ddp-grade.json"
TORCH_VERSION = "2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# pyproject.toml's dependencies but torch, which setup.sh installs first (a test keeps them equal)
KIT_DEPENDENCIES = ["numpy", "click>=8.1", "hypothesis>=6.80"]
VISIBILITY = ("visible", "hidden", "after_due_date", "after_published")  # Gradescope's values
SANDBOX = ("auto", "on", "off")
OUTPUT_LIMIT = 4000  # characters of a problem's details shown in one test's output
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed: the same kit and options give the same bundle, byte for byte

SETUP_SH = f"""#!/usr/bin/env bash
# Gradescope runs this once, as root, while it builds the autograder image: Python, CPU torch
# (pinned) and the ddp-grade kit go into a virtual environment that run_autograder uses.
set -euo pipefail
AUTOGRADER="${{AUTOGRADER_ROOT:-/autograder}}"

apt-get update
apt-get install -y --no-install-recommends python3 python3-venv python3-pip bubblewrap
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {{
    echo "ddp-grade needs Python 3.10 or newer: choose an Ubuntu 22.04 or newer base image" >&2
    exit 1
}}
python3 -m venv "$AUTOGRADER/venv"
"$AUTOGRADER/venv/bin/pip" install --no-cache-dir "torch=={TORCH_VERSION}" --index-url {TORCH_INDEX}
"$AUTOGRADER/venv/bin/pip" install --no-cache-dir "$AUTOGRADER/source/kit"
# What this image can do (the sandbox, above all), for the build log.
"$AUTOGRADER/venv/bin/ddp-grade" doctor --no-group || true
"""

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for every submission: it grades /autograder/submission and writes
# /autograder/results/results.json. A submission that fails its checks is a result, not an error.
AUTOGRADER="${AUTOGRADER_ROOT:-/autograder}"
PYTHON="${DDP_GRADE_PYTHON:-$AUTOGRADER/venv/bin/python}"
cd "$AUTOGRADER"
exec "$PYTHON" -m grader gradescope run --root "$AUTOGRADER"
"""


def pyproject() -> str:
    from grader import __version__

    deps = ", ".join(json.dumps(d) for d in KIT_DEPENDENCIES)
    return f"""[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "ddp-grade"
version = "{__version__}"
description = "ddp-grade, as packed into a Gradescope autograder (torch is installed by setup.sh)"
requires-python = ">=3.10"
dependencies = [{deps}]

[project.scripts]
ddp-grade = "grader.cli:main"

[tool.setuptools.packages.find]
include = ["grader*"]

[tool.setuptools.package-data]
grader = ["*.toml", "quiz/bank/*.toml"]
"""


# --- build ------------------------------------------------------------------------------------


def build(out: Path, exercises: list[catalog.Exercise], options: GradeOptions | None = None, sandbox: str = "auto",
          visibility: str = "visible") -> list[str]:
    """Write the bundle to ``out``; the names it holds. ``options``: how every submission is graded (the
    options every grading command shares), kept in the bundle whole."""
    options = options or GradeOptions()
    config = {"exercises": [ex.id for ex in exercises], "options": options.to_dict(), "sandbox": sandbox,
              "visibility": visibility}
    package = Path(__file__).resolve().parent
    entries: list[tuple[str, bytes, int]] = [
        ("setup.sh", SETUP_SH.encode(), 0o755),
        ("run_autograder", RUN_AUTOGRADER.encode(), 0o755),
        (CONFIG, (json.dumps(config, indent=2) + "\n").encode(), 0o644),
        ("kit/pyproject.toml", pyproject().encode(), 0o644),
    ]
    for path in sorted(package.rglob("*")):
        parts = path.relative_to(package).parts
        if path.is_file() and "__pycache__" not in parts and path.suffix != ".pyc":
            entries.append(("kit/grader/" + "/".join(parts), path.read_bytes(), 0o644))
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name, _ZIP_TIME)
            info.external_attr = (stat.S_IFREG | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            bundle.writestr(info, data)
    return [name for name, _, _ in entries]


# --- run ------------------------------------------------------------------------------------------


def find_files(submission: Path, exercises: list[catalog.Exercise]) -> tuple[dict, dict]:
    """({exercise id: the file to grade}, {exercise id: why there is none, or which file was picked}).

    The file named as in the kit (``03_train.py``) wins, then any ``03_*.py``, the shallowest
    first; with one exercise and no such name, a submission's only ``.py`` file is graded.
    """
    files = sorted((p for p in submission.rglob("*.py") if p.is_file() and not _hidden(p.relative_to(submission))),
                   key=lambda p: (len(p.relative_to(submission).parts), str(p)))
    found: dict[str, Path] = {}
    notes: dict[str, str] = {}
    for ex in exercises:
        name = Path(ex.filename).name  # a debugging exercise's file is debug/21_eval_hang.py in the kit
        exact = [p for p in files if p.name == name]
        named = [p for p in files if catalog.from_filename(p) == ex]
        chosen = (exact or named or [None])[0]
        if chosen is None and len(exercises) == 1 and len(files) == 1:
            chosen = files[0]
            notes[ex.id] = f"graded {files[0].name} as exercise {ex.id} (the submission's only Python file)"
        if chosen is None:
            seen = ", ".join(str(p.relative_to(submission)) for p in files[:10]) or "no Python files"
            notes[ex.id] = f"no {name} in the submission (found: {seen})"
            continue
        found[ex.id] = chosen
        others = [p for p in named if p != chosen]
        if others:
            notes[ex.id] = (f"graded {chosen.relative_to(submission)}; also found "
                            + ", ".join(str(p.relative_to(submission)) for p in others))
    return found, notes


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") or part in ("__pycache__", "__MACOSX") for part in relative.parts)


def results(exercises: list[catalog.Exercise], reports: dict, notes: dict, visibility: str, seconds: float) -> dict:
    """results.json: one test per check of each exercise, scored with the catalog's points (a claim's as the
    module says)."""
    tests = []
    summary = []
    scores = []  # each exercise's: its tests' points, less what its failed claims cost
    for ex in exercises:
        report = reports.get(ex.id)
        by_id = {c["id"]: c for c in (report or {}).get("checks", [])}
        problem = (report or {}).get("problem") or ""
        why_none = notes.get(ex.id, "") if report is None else ""
        lost = 0.0
        for k, check in enumerate(ex.checks, 1):
            got = by_id.get(check.id)
            status = got["status"] if got else None
            passed = status in ("pass", "skip")
            # A claim counts for nothing here (the batch's count_evidence_only): a check that stands on one is
            # worth no point (the same scale for every submission), and its failure costs its points.
            claim = ((got or {}).get("evidence") or check.evidence) not in catalog.ON_EVIDENCE
            worth = 0.0 if claim else check.points
            output = _test_output(got, problem, why_none)
            if claim and status == "fail":
                lost += check.points
                output += (f"\nfailed on what the submission's own processes recorded: costs {check.points:g} "
                           f"point(s) of exercise {ex.id}'s")
            tests.append({
                "name": f"{ex.id} {check.id}: {check.title}",
                "number": f"{int(ex.id)}.{k}",
                "score": worth if passed else 0.0,
                "max_score": worth,
                "status": "passed" if passed or status == "claimed" else "failed",
                "output": output,
                "tags": [f"exercise-{ex.id}"],
                "visibility": visibility,
            })
        ex_tests = tests[-len(ex.checks):]
        scores.append(max(0.0, sum(t["score"] for t in ex_tests) - lost))
        summary.append(_exercise_summary(ex, report, notes.get(ex.id, ""), ex_tests, scores[-1], lost))
    return {
        "score": sum(scores),
        "execution_time": int(round(seconds)),
        "output": "\n\n".join(summary),
        "output_format": "text",
        "test_output_format": "text",
        "test_name_format": "text",
        "stdout_visibility": "hidden",
        "tests": tests,
    }


def _test_output(check: dict | None, problem: str, why_none: str) -> str:
    if check is None:  # nothing graded this exercise, or the file could not be graded at all
        first = problem.splitlines()[0] if problem else "not graded"
        return why_none or f"not graded: {first} (the whole problem is in the output above the tests)"
    status = check["status"]
    if status == "pass":
        return ""
    if status == "skip":
        return f"does not apply here ({check.get('message', '')}); counted as passed"
    if status == "claimed":
        return ("claimed: passed on what the submission's own processes recorded about themselves, which nothing "
                "the grader measured shows; not scored")
    if status == "not-checked":
        return f"{check.get('message', '')}; it can pass once {check.get('likely_cause') or 'that check'} passes"
    lines = [check.get("message", "")]
    where = ", ".join(x for x in (f"rank {check['rank']}" if check.get("rank") is not None else "",
                                  f"world size {check['world_size']}" if check.get("world_size") else "") if x)
    if where:
        lines.append(f"({where})")
    if status == "fail" and check.get("hint"):
        lines.append(f"hint: {check['hint']}")
    return "\n".join(x for x in lines if x)


def _exercise_summary(ex: catalog.Exercise, report: dict | None, note: str, tests: list[dict], got: float,
                      lost: float) -> str:
    total = sum(t["max_score"] for t in tests)
    head = f"Exercise {ex.id} ({ex.title}): {got:g} of {total:g} points"
    if lost:
        head += f" ({lost:g} lost to checks that failed on the submission's own records)"
    if report is None:
        return f"{head}. {note}"
    passed = sum(1 for t in tests if t["status"] == "passed")
    evidence = report.get("evidence") or {}
    claimed = f", {evidence['claimed']} claimed (not scored)" if evidence.get("claimed") else ""
    lines = [f"{head}, {passed} of {len(tests)} checks passed; {evidence.get('decided', 0)} decided on "
             f"evidence{claimed}."]
    if note:
        lines.append(note)
    if report.get("problem"):
        lines.append(_clip(report["problem"] + ("\n" + report["details"] if report.get("details") else "")))
    return "\n".join(lines)


def _clip(text: str) -> str:
    return text if len(text) <= OUTPUT_LIMIT else text[: OUTPUT_LIMIT - 30] + "\n... (cut here)"


def run(root: Path, echo=print) -> int:
    """Grade ``root/submission`` as ``root/source/ddp-grade.json`` says; write ``root/results/results.json``."""
    from grader import batch, sandbox

    started = time.monotonic()
    config_path = root / "source" / CONFIG
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        exercises = [catalog.by_id(i) for i in config["exercises"]]
        if None in exercises:
            raise ValueError(f"unknown exercise in {config['exercises']}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        echo(f"ddp-grade: the autograder's {config_path} cannot be used: {exc}")
        return EXIT_UNUSABLE
    wanted = config.get("sandbox", "auto")
    tool = sandbox.tool() if wanted != "off" else None
    if wanted == "on" and tool is None:
        echo("ddp-grade: the bundle asks for a sandbox, but neither bwrap nor unshare works in this image "
             "(rebuild it with `ddp-grade gradescope build --sandbox auto`)")
        return EXIT_UNUSABLE
    echo(f"sandbox: {tool or 'none'} ({wanted})")
    found, notes = find_files(root / "submission", exercises)
    submissions = [batch.Submission(f"{ex_id}: {path.name}", str(path), ex_id) for ex_id, path in found.items()]
    if "options" in config:
        options = GradeOptions.from_dict(config["options"])
    else:  # a bundle built before the options were kept whole
        options = GradeOptions(world_size=config.get("world_size"),
                               timeout_s=float(config.get("timeout_s", DEFAULT_TIMEOUT_S)))
    outcomes = batch.run_batch(submissions, max(1, min(len(submissions), batch.default_jobs())), options.to_dict(),
                               on_done=lambda o: echo(f"{o.submission.name}: {o.status}"), sandbox=tool)
    reports = {o.submission.exercise: o.report for o in outcomes}
    data = results(exercises, reports, notes, config.get("visibility", "visible"), time.monotonic() - started)
    out = root / "results" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out)
    echo(data["output"])
    echo(f"score {data['score']:g}; results written to {out}")
    return EXIT_OK
