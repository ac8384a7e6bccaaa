"""What exercises 41-43 cost and how close the kit's cost model is: for each small configuration 41 and 42
measure (and with --frontier those tests/test_capacity_measured.py adds: grouped-query attention, SwiGLU,
sequence and context parallelism, interleaved stages, experts...), the model's figures beside the real
run's, with the time of that run; the time the model takes for every published row and for the planner's
search beside 43's; then warm gradings.

One run on this machine's CPU, gloo, one compute thread per rank (as the grader's ranks have):
  - each configuration of grader/checks/shared/capacity_cases.py trained for one step by the kit's own
    implementation (grader/rank/drivers/shared/capacity_run.py) on dp x tp x pp ranks through a warm pool:
    rank 0's bytes (params, grads, optimizer, activations), the bytes its collectives send (ring model),
    and its FLOPs (FlopCounterMode), each beside grader/capacity.py's figure; the run's wall time beside
    the time the cost model takes to answer (the baseline: an estimate is microseconds, a measurement a
    real training step);
  - warm gradings of solutions/41, 42 and 43 (or --files yours): the first one of 41 measures every
    configuration, the later ones reuse its measurements (the grader keeps them for the process).

    python benchmarks/bench_capacity.py [--frontier] [--gradings 3] [--files solutions/41_memory.py ...]

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


def measure_each(session, configurations: dict) -> None:
    """Each configuration ({name: (model, plan)}) trained for one step, rank 0's figures beside the model's."""
    from collections import Counter

    print(f"{'configuration':<30}{'ranks':>6}{'run s':>8}{'model us':>10}  term: model / measured (difference)")
    for name, (model, plan) in configurations.items():
        kwargs = cases.measure_kwargs(model, plan)
        start = time.perf_counter()
        outcome = session.run("grader.rank.drivers.shared.capacity_run:measure_main", plan.world_size,
                              learner_path=str(ROOT / "solutions" / "41_memory.py"), timeout_s=120, kwargs=kwargs)
        run_s = time.perf_counter() - start
        record = outcome.results()[0]
        start = time.perf_counter()
        memory = capacity.training_memory(model, plan)
        calls = capacity.collective_list(model, plan)
        flops = capacity.flops(model, plan)
        model_us = (time.perf_counter() - start) * 1e6
        cells = [f"{t} {getattr(memory, t):,.0f} / {record[f'{t}_bytes']:,} ({_rel(getattr(memory, t), record[f'{t}_bytes'])})"
                 for t in TERMS]
        said = Counter()
        for dimension, op, count, size in calls:
            said[dimension, op, size] += count
        seen = Counter((dimension, op, size) for dimension, op, size in record["collectives"])
        cells.append(f"collectives {sum(said.values())} / {sum(seen.values())} ({'equal' if said == seen else 'DIFFER'})")
        cells.append(f"FLOPs {flops:,} / {record['flops']:,} ({_rel(flops, record['flops'])})")
        print(f"{name:<30}{plan.world_size:>6}{run_s:>8.2f}{model_us:>10.0f}  " + "; ".join(cells))


def model_answers() -> None:
    """The cost model's own time: every published row, 43's search and the planner's."""
    from grader import capacity_plans as plans
    from grader.commands.plan import published_rows

    start = time.perf_counter()
    rows = published_rows()
    print(f"\nthe cost model's answers (seconds, wall): {len(rows)} published rows {time.perf_counter() - start:.3f}")
    for name, (model, cluster, tokens) in {**plans.SCENARIOS, **plans.FRONTIER}.items():
        space = plans.candidate_plans if name in plans.SCENARIOS else plans.planner_plans
        # each search under the step time it answers with: 43's under 42's, the planner's under the kit's
        timer = plans.timer_for(cluster, flat=name in plans.SCENARIOS) if hasattr(plans, "timer_for") else None
        start = time.perf_counter()
        count = len(list(space(model, cluster, tokens)))
        if timer is None:
            plans.fastest(model, cluster, space(model, cluster, tokens))
        else:
            plans.fastest(model, cluster, space(model, cluster, tokens), timer)
        print(f"  {name:<46} {'43' if name in plans.SCENARIOS else 'planner':>8} {count:>6} plans "
              f"{time.perf_counter() - start:.3f}")


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
    parser.add_argument("--frontier", action="store_true", help="also the frontier's configurations")
    parser.add_argument("--files", nargs="+", default=[str(ROOT / "solutions" / f) for f in
                                                        ("41_memory.py", "42_traffic.py", "43_plan.py")])
    args = parser.parse_args()
    import torch

    from grader import grading
    from grader.rank import harness

    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; "
          f"the small transformer: {capacity.total_params(cases.SMALL):,} parameters, {cases.SMALL}")
    grading.warm_up()
    configurations = {name: (cases.SMALL, plan) for name, plan in cases.CONFIGS.items()}
    if args.frontier:
        sys.path.insert(0, str(ROOT / "tests"))
        from test_capacity_measured import FRONTIER_CASES

        configurations.update(FRONTIER_CASES)
    with harness.Session(spares=True) as session:
        measure_each(session, configurations)
        model_answers()
        gradings(session, [str(Path(f).resolve()) for f in args.files], args.gradings)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
