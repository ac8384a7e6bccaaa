"""What exercise 34's grading costs: the graded pipelines on W ranks beside the same steps in one process.

One run on this machine's CPU, gloo, one compute thread per process (as the grader's ranks have):
  - pipelined: on W ranks, what each rank's grading driver does once torch is imported, for each
    schedule (GPipe, 1F1B, Interleaved1F1B): build_pipeline (solutions/34_pipelining.py, or --file
    yours) on the grader's model, then three train_step calls with SGD. The slowest rank's time, the
    median over --reps repetitions in the same process group (the first one, where the schedules'
    first steps also exchange the stages' shapes, shown apart). The driver's measurements (the
    walks over what each rank holds, the hooks) are not included;
  - one process: the same steps with no pipeline: the grader's own replay (the whole model, the
    micro-batches' gradients accumulated, SGD), for the three schedules' models;
  - a warm grading: `ddp-grade` on the file through a warm pool (torch and the checks imported, as
    the grading server keeps them), world sizes 2 and 3 as graded by default, timed from the request
    to the report (--gradings of them, after one that is not counted), with the CPU time it took in
    all (the grader's process and every rank).

    python benchmarks/bench_pipelining.py [--file solutions/34_pipelining.py] [--world-sizes 2 3]
                                          [--reps 5] [--gradings 3]

Not a test: timings depend on the machine, and on what else runs on it (the load average is
printed before and after). The model is tiny: what the pipelined figures show is the schedules'
own cost (their messages, the shape exchange of the first step), not a speed-up.
"""

import argparse
import importlib
import importlib.util
import os
import queue
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fsdp2 import warm_gradings  # noqa: E402  (one way to time a warm grading, for every benchmark)

from grader.rank.drivers import ex34_pipelining as ex  # noqa: E402
from grader.checks.ex34_pipelining import reference as grading_side  # noqa: E402


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graded_steps(learner, rank: int, world_size: int) -> None:
    """What the grading driver runs in one rank once torch is imported, without its measurements."""
    for schedule_name in ex.SCHEDULES:
        model = ex.build_model(schedule_name, world_size)
        schedule, modules = learner.build_pipeline(model, rank, world_size, ex.n_microbatches(world_size),
                                                   schedule_name, torch.device("cpu"))
        del model
        optimizer = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=ex.LR)
        for step in range(ex.STEPS):
            tokens, targets = ex.make_batch(schedule_name, world_size, step)
            learner.train_step(schedule, tokens, targets, rank, world_size, optimizer)


def worker(rank: int, world_size: int, port: int, reps: int, file: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # as in the warm pool: torch.optim imports it
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    learner = load(Path(file))
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        graded_steps(learner, rank, world_size)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    results.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def pipelined(world_size: int, reps: int, file: str) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of the slowest rank: its first run, and the median of its later runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world_size, port, reps, file, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    times = {}
    while len(times) < world_size:
        try:
            rank, seconds = results.get(timeout=1)
            times[rank] = seconds
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                sys.exit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join(timeout=60)
    walls = [max(times[r][i][0] for r in times) for i in range(reps + 1)]
    cpus = [max(times[r][i][1] for r in times) for i in range(reps + 1)]
    return [(walls[0], cpus[0]), (statistics.median(walls[1:]), statistics.median(cpus[1:]))]


def one_process(world_size: int, reps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the grader's replay of the three schedules' steps, medians."""
    torch.set_num_threads(1)
    walls, cpus = [], []
    for _ in range(reps):
        start, cpu = time.perf_counter(), time.process_time()
        for schedule_name in ex.SCHEDULES:
            grading_side.reference_run(schedule_name, world_size)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=str(ROOT / "solutions" / "34_pipelining.py"))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gradings", type=int, default=3)
    args = parser.parse_args()
    file = str(Path(args.file).resolve())
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; for each of "
          f"{', '.join(ex.SCHEDULES)}: {ex.STEPS} steps of a float64 model of 2W blocks, "
          f"2W micro-batches of {ex.ROWS} x {ex.SEQ} tokens")
    print("seconds, wall / CPU (the slowest rank's CPU for the pipelined runs), the three schedules together")
    print(f"{'':>9}" + "".join(f"{title:>19}" for title in ("pipelined, 1st run", "pipelined, later", "one process")))
    for world_size in args.world_sizes:
        first, later = pipelined(world_size, args.reps, file)
        alone = one_process(world_size, args.reps)
        cells = "".join(f"{wall:>11.3f} / {cpu:.3f}" for wall, cpu in (first, later, alone))
        print(f"{world_size} ranks  {cells}  (later pipelined / one process, wall: {later[0] / alone[0]:.1f}x)")
    if args.gradings:
        timed = warm_gradings(file, args.gradings)
        walls, cpus = [w for w, _ in timed], [c for _, c in timed]
        print(f"warm grading (world sizes {' and '.join(map(str, ex_world_sizes()))}): wall "
              f"{', '.join(f'{w:.1f}' for w in walls)} s (median {statistics.median(walls):.1f} s); CPU of the "
              f"grader and every rank {', '.join(f'{c:.1f}' for c in cpus)} s (median {statistics.median(cpus):.1f} s)")
    print(f"load average {os.getloadavg()[0]:.1f}")


def ex_world_sizes() -> tuple[int, ...]:
    from grader import catalog

    return catalog.by_id("34").world_sizes


if __name__ == "__main__":
    main()
