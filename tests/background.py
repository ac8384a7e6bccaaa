"""Jobs that run in one background process while the rest of the suite goes on.

Some tests wait far more than they compute: a grading of exercise 15 starts real torchrun jobs
(about 30 s each, most of it waiting for agents and restarts), a deadlock variant waits out its
deadline, a debugging-track script hangs until the grader stops it. ``tests/conftest.py`` collects
the jobs the selected tests will ask for, and one background process runs them one after
another from the start of the run, so that their waiting overlaps the rest of the suite. A test
gets the same result it would have computed itself: the same call, on the same file, with the
same options. Every test still asserts on it.

A test declares the jobs its parameters ask for with a mark, where it lists them: ``background.grading(path,
options)`` or ``background.command(path, args, timeout_s)`` in ``pytest.param(..., marks=...)``;
``tests/conftest.py`` collects the marks of the selected tests, whatever the tests are called. What waits:
``waits(path, header)``, from the variant's header (a deadline it runs to) or its exercise (15 starts
real torchrun jobs), and every debugging-track script as shipped.

Two kinds of job:
- ``grade``: ``grade_file`` in a warm harness session, the ``grade`` fixture's own call; the result
  is the report.
- ``cli``: ``python -m grader FILE ARGS`` as a command of its own, with a tag in its environment;
  the result is its exit code, its output, and the processes still carrying the tag the moment
  it exited.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "@@job "  # a line of the background process's output that carries one job's result
GRADE_TIMEOUT_S = 60.0  # a grading's deadline in the tests, unless a test sets its own
WAITING_EXERCISES = ("15",)  # every grading of these starts real torchrun jobs


def grade_key(path, options: dict) -> str:
    return "grade " + json.dumps([str(Path(path).resolve()), sorted(options.items())])


def cli_key(path, args: list[str]) -> str:
    return "cli " + json.dumps([str(Path(path).resolve()), list(args)])


def waits(path, expected: dict | None = None) -> bool:
    """Whether grading ``path`` waits more than it computes: a file of a waiting exercise, or a variant whose
    header (``expected``, tests/test_variants.py's reading of it) says it runs to a deadline."""
    if Path(path).name.startswith(tuple(f"{n}_" for n in WAITING_EXERCISES)):
        return True
    return bool(expected) and (expected["status"] == "timeout" or "finishes" in expected["fail"])


def grading(path, options: dict | None = None):
    """The mark of a test that grades ``path`` with ``options`` (the ``grade`` fixture's call): run it in
    the background."""
    import pytest

    options = options or {}
    job = {"kind": "grade", "key": grade_key(path, options), "path": str(path), "options": sorted(options.items())}
    return pytest.mark.background(job=job)


def command(path, args: list[str], timeout_s: float):
    """The mark of a test that runs ``ddp-grade path args`` (the ``cli_grading`` fixture's call) in the background."""
    import pytest

    job = {"kind": "cli", "key": cli_key(path, list(args)), "path": str(path), "args": list(args),
           "timeout_s": timeout_s}
    return pytest.mark.background(job=job)


def processes_with(entry: str) -> list[int]:
    """Pids of the processes whose environment has ``entry`` (``NAME=value``): every descendant of a
    command started with it inherits it."""
    found = []
    needle = entry.encode()
    for process in Path("/proc").iterdir():
        if process.name.isdigit():
            try:
                if needle in (process / "environ").read_bytes().split(b"\0"):
                    found.append(int(process.name))
            except OSError:
                pass
    return found


def processes_carrying(tag: str) -> list[int]:
    """Pids of the processes whose environment has ``DDP_GRADE_TEST_TAG=tag``."""
    return processes_with(f"DDP_GRADE_TEST_TAG={tag}")


def cli_grading(path, args: list[str], state_dir, timeout_s: float) -> dict:
    """Grade ``path`` with the command line; what it printed and what it left alive at exit."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "DDP_GRADE_TEST_TAG": tag, "DDP_GRADE_STATE_DIR": str(state_dir)}
    done = subprocess.run([sys.executable, "-m", "grader", str(path), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    left = processes_carrying(tag)  # looked at the moment the command has exited
    return {"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr[-3000:], "left": left}


def _run_jobs(jobs: list[dict], state_dir: str) -> None:
    """The background process: run each job, print one marked line with its result."""
    from grader import grading
    from grader.rank import harness
    from grader.grading import GradeOptions, grade_file

    with contextlib.ExitStack() as stack:
        session = None
        for n, job in enumerate(jobs):
            if job["kind"] == "grade":
                if session is None:
                    grading.warm_up()
                    session = stack.enter_context(harness.Session())
                options = {"timeout_s": GRADE_TIMEOUT_S, **dict(job["options"])}
                result = grade_file(job["path"], session, GradeOptions(**options), None).to_dict()
            else:
                state = os.path.join(state_dir, f"cli-{n}")
                result = cli_grading(job["path"], job["args"], state, job["timeout_s"])
            print(MARK + json.dumps({"key": job["key"], "result": result}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this kit's grader, as a test run from ROOT imports it
    _run_jobs(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
