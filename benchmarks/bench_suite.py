"""Wall and CPU time of the test suite at two commits, side by side on this machine, one after the other.

    python benchmarks/bench_suite.py [--base COMMIT] [--head COMMIT] [--quick-only] [--keep FOLDER]

Absolute minutes vary too much from run to run to be a target; the ratio of two runs on the same
machine, one right after the other, is the figure (the target: the head at most 1.2 times the
base). Each commit is checked out into a temporary worktree that uses this checkout's virtual
environment (the kit itself is put first on the path), and its suite runs as `python -m pytest -q`
in a fresh process. CPU time is the children's (user + system), from ``os.wait4``. The slowest
test files of each run are listed from pytest's durations, so a regression can be found; --keep saves
each run's whole pytest output (every test's duration) as FOLDER/<commit>.txt.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 1.2


def run(tree: Path, args: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the run and everything it started, pytest's output) of one run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=tree,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    if process.returncode != 0:
        print(output[-3000:])
        print(f"note: pytest {' '.join(args)} in {tree} exited {process.returncode}: {summary}")
    return elapsed, usage.ru_utime + usage.ru_stime, output


def by_file(output: str) -> list[tuple[str, float]]:
    totals: dict[str, float] = collections.defaultdict(float)
    for seconds, path in re.findall(r"^([\d.]+)s \w+\s+(tests/[^:\s]+)", output, re.M):
        totals[path] += float(seconds)
    return sorted(totals.items(), key=lambda item: -item[1])


def worktree(commit: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="ddp-grade-suite-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), commit], cwd=ROOT, check=True,
                   capture_output=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1", help="the commit to compare with (default: HEAD~1)")
    parser.add_argument("--head", default="HEAD", help="the commit measured (default: HEAD)")
    parser.add_argument("--quick-only", action="store_true", help="time only the quick subset")
    parser.add_argument("--keep", type=Path, help="a folder to save each run's pytest output in")
    args = parser.parse_args()

    selection = ["-m", "not slow"] if args.quick_only else ["--durations=0"]
    rows, slowest = [], {}
    for name in (args.base, args.head):
        tree = worktree(name)
        try:
            wall, cpu, output = run(tree, selection)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
            shutil.rmtree(tree, ignore_errors=True)
        summary = output.strip().splitlines()[-1] if output.strip() else ""
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            (args.keep / f"{name.replace('/', '_')}.txt").write_text(output)
        rows.append((name, wall, cpu, summary))
        slowest[name] = by_file(output)[:8]

    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end; "
          f"{'quick subset' if args.quick_only else 'whole suite'}")
    print(f"{'commit':16} {'wall s':>8} {'CPU s':>8}  pytest")
    for name, wall, cpu, summary in rows:
        print(f"{name:16} {wall:8.1f} {cpu:8.1f}  {summary}")
    (_, base_wall, base_cpu, _), (_, head_wall, head_cpu, _) = rows
    print(f"head / base: wall {head_wall / base_wall:.2f}x, CPU {head_cpu / base_cpu:.2f}x "
          f"(target: at most {TARGET_RATIO}x)")
    for name, files in slowest.items():
        if files:
            print(f"\nslowest test files at {name}:")
            for path, seconds in files:
                print(f"  {seconds:7.1f} s  {path}")


if __name__ == "__main__":
    main()
