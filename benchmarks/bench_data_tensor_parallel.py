"""What exercise 19's grading costs: make_groups and train_2d on W ranks (dp x tp) beside the same training
in one process on the global batch.

One run on this machine's CPU, gloo, one compute thread per process (as the grader's ranks have):
  - 2-D: on W ranks, what each rank's grading driver does once torch is imported: the learner's
    make_groups (solutions/19_data_tensor_parallel.py, or --file yours), then its train_2d on the grader's
    data (every group made again, the model, the steps, the gathered state dict). The slowest rank's
    time, the median over --reps repetitions in the same process group (the first one, with the first
    groups' connections, shown apart);
  - one process: the grader's own dense run of the same steps on the whole batch;
  - a warm grading: `ddp-grade` on the file through a warm pool (world sizes 4 and 2 and the run with bad
    input, as graded by default), timed from the request to the report (--gradings of them, after one
    that is not counted), with the CPU time of the grader and every rank.

    python benchmarks/bench_data_tensor_parallel.py [--file solutions/19_data_tensor_parallel.py]
                                                    [--world-sizes 4 2] [--reps 3] [--gradings 3]

Not a test: timings depend on the machine, and on what else runs on it (the load average is printed
before and after). Four ranks on two cores share them, and the model is tiny: what this shows is what
a grading spends where (connecting groups, not computing), not what 2-D parallelism gains.
"""

import argparse
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

from grader.rank.drivers import ex19_data_tensor_parallel as rank_side  # noqa: E402
from grader.checks.ex19_data_tensor_parallel.reference import reference_run  # noqa: E402


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graded_work(learner, rank: int, world_size: int, tp_size: int) -> None:
    learner.make_groups(world_size, tp_size)
    learner.train_2d(rank, world_size, tp_size, rank_side.make_data(), rank_side.STEPS, rank_side.LR)


def worker(rank: int, world_size: int, tp_size: int, port: int, reps: int, file: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    learner = load(Path(file))
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        graded_work(learner, rank, world_size, tp_size)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    results.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def two_d(world_size: int, reps: int, file: str) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of the slowest rank: its first run, and the median of its later runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    tp_size = rank_side.tp_size_for(world_size)
    procs = [ctx.Process(target=worker, args=(r, world_size, tp_size, port, reps, file, results))
             for r in range(world_size)]
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


def one_process(reps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the grader's dense run, medians."""
    torch.set_num_threads(1)
    walls, cpus = [], []
    for _ in range(reps):
        start, cpu = time.perf_counter(), time.process_time()
        reference_run()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def world_sizes() -> tuple[int, ...]:
    from grader import catalog

    return catalog.by_id("19").world_sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=str(ROOT / "solutions" / "19_data_tensor_parallel.py"))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gradings", type=int, default=3)
    args = parser.parse_args()
    file = str(Path(args.file).resolve())
    fc1, fc2 = rank_side.dense_layers()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; "
          f"{rank_side.STEPS} steps of a {sum(p.numel() for p in (*fc1.parameters(), *fc2.parameters()))}-parameter "
          f"MLP on {rank_side.ROWS} rows (float64)")
    print("seconds, wall / CPU (the slowest rank's CPU for the 2-D runs)")
    print(f"{'':>14}" + "".join(f"{title:>19}" for title in ("2-D, 1st run", "2-D, later", "one process")))
    alone = one_process(max(args.reps, 3))
    for world_size in args.world_sizes:
        first, later = two_d(world_size, args.reps, file)
        cells = "".join(f"{wall:>11.3f} / {cpu:.3f}" for wall, cpu in (first, later, alone))
        shape = f"{world_size // rank_side.tp_size_for(world_size)}x{rank_side.tp_size_for(world_size)}"
        print(f"{world_size} ranks ({shape})  {cells}  (later 2-D / one process, wall: {later[0] / alone[0]:.0f}x)")
    if args.gradings:
        timed = warm_gradings(file, args.gradings)
        walls, cpus = [w for w, _ in timed], [c for _, c in timed]
        print(f"warm grading (world sizes {' and '.join(map(str, world_sizes()))}): wall "
              f"{', '.join(f'{w:.1f}' for w in walls)} s (median {statistics.median(walls):.1f} s); CPU of the "
              f"grader and every rank {', '.join(f'{c:.1f}' for c in cpus)} s (median {statistics.median(cpus):.1f} s)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
