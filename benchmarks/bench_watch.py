"""Save-to-verdict time in a warm `ddp-grade watch` session, next to a cold `ddp-grade FILE` run.

For each of exercises 01-03: a temporary copy of the reference solution is watched by the same
loop and the same single harness session that `ddp-grade watch` uses; the script then "saves"
the file (appends a comment with a new number) several times and measures, for each save, the
time from the write to the finished report. The median is printed beside the same loop in a
session without spares (ranks forked when each run starts), and beside the wall time of a
cold `ddp-grade FILE --quiet` (a fresh process: import torch, start the process pool, grade).

    python benchmarks/bench_watch.py [--saves 5] [--exercises 01,02,03]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grader import catalog, grading  # noqa: E402
from grader.rank import harness  # noqa: E402
from grader.commands.watch import watch_loop  # noqa: E402
from grader.grading import GradeOptions, grade_file  # noqa: E402


def warm(ex: catalog.Exercise, saves: int, session: harness.Session) -> tuple[list[float], str]:
    folder = Path(tempfile.mkdtemp(prefix="bench-watch-"))
    path = folder / ex.filename
    shutil.copy(ROOT / "solutions" / ex.filename, path)
    saved_at: list[float] = []
    times: list[float] = []
    statuses: list[str] = []
    graded = threading.Semaphore(0)
    stop = threading.Event()

    def on_change(n: int) -> None:
        report = grade_file(str(path), session, GradeOptions(timeout_s=120))
        if n > 1:  # the first grading is at watch start, not after a save
            times.append(time.monotonic() - saved_at[-1])
            statuses.append(report.status)
        graded.release()

    loop = threading.Thread(target=watch_loop, args=(path, on_change),
                            kwargs={"stop": stop, "max_grades": saves + 1}, daemon=True)
    loop.start()
    graded.acquire()
    for k in range(saves):
        time.sleep(0.5)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"\n# save {k}\n")
        saved_at.append(time.monotonic())
        graded.acquire()
    stop.set()
    loop.join()
    shutil.rmtree(folder, ignore_errors=True)
    return times, ",".join(sorted(set(statuses)))


def cold(ex: catalog.Exercise) -> tuple[float, int]:
    env = {**os.environ, "DDP_GRADE_STATE_DIR": tempfile.mkdtemp(prefix="bench-state-")}
    started = time.monotonic()
    # `python -m grader` is `ddp-grade`, without needing the virtual environment on PATH.
    command = [sys.executable, "-m", "grader", str(ROOT / "solutions" / ex.filename), "--quiet", "--no-server"]
    proc = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - started, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--exercises", default="01,02,03")
    args = parser.parse_args()
    wanted = [catalog.by_id(x) for x in args.exercises.split(",")]
    print(f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}, {args.saves} saves per exercise")
    print(f"{'exercise':<10} {'watch: save->verdict median':>28} {'(min-max)':>14} {'no spares':>10} "
          f"{'cold ddp-grade FILE':>20}")
    # `ddp-grade watch NN` warms the pool once, for its exercise. One process serves every
    # exercise here, and its pool can be started only once: give it what the most demanding needs.
    grading.warm_up(dynamo=any(ex.preload_dynamo for ex in wanted))
    for ex in wanted:
        with harness.Session(spares=True) as session:  # as `ddp-grade watch` makes it
            times, status = warm(ex, args.saves, session)
        with harness.Session() as session:  # every rank forked when its run starts
            bare, _ = warm(ex, args.saves, session)
        cold_s, rc = cold(ex)
        print(f"{ex.id + ' ' + ex.slug:<10} {statistics.median(times):>26.2f} s "
              f"{f'({min(times):.2f}-{max(times):.2f})':>14} {statistics.median(bare):>8.2f} s "
              f"{cold_s:>18.2f} s   [watch: {status}; cold exit {rc}]")


if __name__ == "__main__":
    main()
