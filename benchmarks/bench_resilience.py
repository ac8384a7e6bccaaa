"""What grading exercise 44 costs, beside the same work in one process, and how close the kit's model is
to its simulation: for each job 44 simulates, the model's goodput beside the seeded simulation's (400,000
failures) with the simulation's time; the time to answer every case the grading asks, in this process;
then warm gradings of the solution (or --files yours) through a warm pool, where the learner's functions
answer in a worker process.

    python benchmarks/bench_resilience.py [--gradings 3] [--files solutions/44_goodput.py ...]

Not a test: timings depend on the machine and on what else runs on it (the load average is printed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DDP_GRADE_SERVER", "0")

from grader import resilience as rs  # noqa: E402

CHECKS = "grader.checks.ex44_goodput"


def simulations(checks) -> None:
    """Each simulated job: the model's goodput, the simulation's and its interval, the simulation's time."""
    print(f"{'job':<80}{'model':>8}{'simulated':>11}{'99.9 % interval':>20}{'sim s':>7}")
    for name, (cluster, job) in {**checks.BLOCKING, **checks.ASYNCHRONOUS}.items():
        start = time.perf_counter()
        sim = rs.simulate(cluster, job, checks.FAILURES, seed=f"{checks.SEED}:{name}")
        seconds = time.perf_counter() - start
        print(f"{name[:79]:<80}{rs.goodput(cluster, job):>8.4f}{sim.goodput:>11.4f}"
              f"{f'{sim.low:.4f} to {sim.high:.4f}':>20}{seconds:>7.2f}")


def in_process(checks, file: Path) -> None:
    """The cases a grading asks, answered by ``file``'s functions in this process (no worker, no pickling)."""
    spec = importlib.util.spec_from_file_location("learner44", file)
    learner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(learner)
    goodput_cases = [*checks.BLOCKING.values(), *checks.ASYNCHRONOUS.values(), (checks.LLAMA3, checks.HOURLY_FREE),
                     *[(checks.LLAMA3, rs.llama3_job(restart_s=r)) for r in checks.RESTARTS]]
    interval_cases = [*checks.SHORT_SAVES.values(), *checks.LONG_SAVES.values()]

    def build(cluster, job):
        return learner.Cluster(cluster.gpus, cluster.gpu_failure_rate), learner.Job(
            job.interval_s, job.save_s, job.restart_s, job.reload_s, job.asynchronous, job.stall_s)

    start = time.perf_counter()
    for cluster, job in goodput_cases:
        learner.goodput(*build(cluster, job))
    for cluster, job in interval_cases:
        learner.best_checkpoint_interval(*build(cluster, job))
    seconds = time.perf_counter() - start
    print(f"\n{file.name}: {len(goodput_cases)} goodputs and {len(interval_cases)} best intervals in this process: "
          f"{seconds * 1e3:.2f} ms")


def gradings(session, files: list[str], count: int) -> None:
    from grader.grading import GradeOptions, grade_file

    print("\nwarm gradings (seconds, wall): the first (the simulations run once per process), then the later ones")
    for file in files:
        walls = []
        for _ in range(count + 1):
            start = time.perf_counter()
            report = grade_file(file, session, GradeOptions())
            walls.append(time.perf_counter() - start)
            if report.status != "passed":
                sys.exit(f"{file} did not pass: {report.status}")
        later = sorted(walls[1:])[len(walls[1:]) // 2] if count else float("nan")
        print(f"  {Path(file).name:<20} first {walls[0]:.2f}   later (median of {count}) {later:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gradings", type=int, default=3)
    parser.add_argument("--files", nargs="+", default=[str(ROOT / "solutions" / "44_goodput.py")])
    args = parser.parse_args()
    import importlib

    import torch

    from grader import grading
    from grader.rank import harness

    checks = importlib.import_module(CHECKS)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}")
    simulations(checks)
    for file in args.files:
        in_process(checks, Path(file).resolve())
    grading.warm_up()
    with harness.Session(spares=True) as session:
        gradings(session, [str(Path(f).resolve()) for f in args.files], args.gradings)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
