"""Wall time of the test suite, whole and quick subset, side by side with the 5-minute target.

    python benchmarks/bench_suite.py [--quick-only]

Each is run once as `python -m pytest -q` in a fresh process (the suite starts its own warm
grading session); the figures are wall-clock seconds, and the slowest test files are listed
from pytest's own durations so a regression can be found.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 300


def run(args: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                            cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]
    if result.returncode != 0:
        print(result.stdout[-3000:])
        sys.exit(f"pytest {' '.join(args)} failed (exit {result.returncode}): {summary}")
    return elapsed, result.stdout


def by_file(output: str) -> list[tuple[str, float]]:
    totals: dict[str, float] = collections.defaultdict(float)
    for seconds, path in re.findall(r"^([\d.]+)s \w+\s+(tests/[^:\s]+)", output, re.M):
        totals[path] += float(seconds)
    return sorted(totals.items(), key=lambda item: -item[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick-only", action="store_true", help="time only the quick subset")
    args = parser.parse_args()

    quick, _ = run(["-m", "not slow"])
    rows = [("quick subset (-m 'not slow')", quick)]
    slowest: list[tuple[str, float]] = []
    if not args.quick_only:
        whole, output = run(["--durations=0"])
        rows.append(("whole suite", whole))
        slowest = by_file(output)[:10]

    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'what':34} {'wall s':>8} {'vs 5-min target':>16}")
    for name, seconds in rows:
        print(f"{name:34} {seconds:8.1f} {seconds / TARGET_S:15.2f}x")
    if slowest:
        print("\nslowest test files (sum of setup, call and teardown):")
        for path, seconds in slowest:
            print(f"  {seconds:7.1f} s  {path}")


if __name__ == "__main__":
    main()
