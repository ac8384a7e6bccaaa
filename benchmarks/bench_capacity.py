"""What exercises 41-43 cost and how close the kit's cost model is: for each small configuration 41 and 42
measure, the model's figures beside the real run's, with the time of that run; then warm gradings.

One run on this machine's CPU, gloo, one compute thread per rank (as the grader's ranks have):
  - each configuration of grader/checks/shared/capacity_cases.py trained for one step by the kit's own
    implementation (grader/checks/shared/capacity_run.py) on dp x tp x pp ranks through a warm pool:
    rank 0's bytes (params, grads, optimizer, activations), the bytes its collectives send (ring model),
    and its FLOPs (FlopCounterMode), each beside grader/capacity.py's figure; the run's wall time beside
    the time the cost model takes to answer (the baseline: an estimate is microseconds, a measurement a
    real training step);
  - warm gradings of solutions/41, 42 and 43 (or --files yours): the first one of 41 measures every
    configuration, the later ones reuse its measurements (the grader keeps them for the process).

    python benchmarks/bench_capacity.py [--gradings 3] [--files solutions/41_memory.py ...]

Not a test: timings depend on the machine and on what else runs on it (the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DDP_GRADE_SERVER", "0")

from grader import capacity  # noqa: E402
from grader.checks.shared import capacity_cases as cases  # noqa: E402

TERMS = ("params", "grads", "optimizer", "activations")


def measure_each(session) -> None:
    from grader.checks.ex42_traffic import measured_traffic

    print(f"{'configuration':<26}{'ranks':>6}{'run s':>8}{'model us':>10}  term: model / measured (difference)")
    for name, plan in cases.CONFIGS.items():
        kwargs = {**cases.plain(cases.SMALL, plan), "seed": cases.SEED}
        start = time.perf_counter()
        outcome = session.run("grader.checks.shared.capacity_run:measure_main", plan.world_size,
                              learner_path=str(ROOT / "solutions" / "41_memory.py"), timeout_s=120, kwargs=kwargs)
        run_s = time.perf_counter() - start
        record = outcome.results()[0]
        start = time.perf_counter()
        memory = capacity.training_memory(cases.SMALL, plan)
        traffic = capacity.communication(cases.SMALL, plan)
        flops = capacity.flops(cases.SMALL, plan)
        model_us = (time.perf_counter() - start) * 1e6
        cells = [f"{t} {getattr(memory, t):,.0f} / {record[f'{t}_bytes']:,} ({_rel(getattr(memory, t), record[f'{t}_bytes'])})"
                 for t in TERMS]
        sent = measured_traffic(record, plan)
        said = {(d, n): v for d in capacity.DIMENSIONS for n, v in getattr(traffic, d).items()}
        cells.append(f"sent {sum(said.values()):,.0f} / {sum(sent.values()):,.0f} ({_rel(sum(said.values()), sum(sent.values()))})")
        cells.append(f"FLOPs {flops:,} / {record['flops']:,} ({_rel(flops, record['flops'])})")
        print(f"{name:<26}{plan.world_size:>6}{run_s:>8.2f}{model_us:>10.0f}  " + "; ".join(cells))


def _rel(model: float, measured: float) -> str:
    if measured == 0:
        return "equal" if model == 0 else "measured 0"
    diff = (model - measured) / measured
    return "equal" if diff == 0 else f"{diff:+.2%}"


def gradings(session, files: list[str], count: int) -> None:
    from grader.grading import GradeOptions, grade_file

    print("\nwarm gradings (seconds, wall): the first, then the later ones")
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
    parser.add_argument("--files", nargs="+", default=[str(ROOT / "solutions" / f) for f in
                                                        ("41_memory.py", "42_traffic.py", "43_plan.py")])
    args = parser.parse_args()
    import torch

    from grader import grading, harness

    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; "
          f"the small transformer: {capacity.total_params(cases.SMALL):,} parameters, {cases.SMALL}")
    grading.warm_up()
    with harness.Session(spares=True) as session:
        measure_each(session)
        gradings(session, [str(Path(f).resolve()) for f in args.files], args.gradings)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
