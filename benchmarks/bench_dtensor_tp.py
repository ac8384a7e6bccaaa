"""What exercise 32's grading costs: the graded steps on W ranks (dp x tp) beside the dense model in one process.

One run on this machine's CPU, gloo, one compute thread per process (as the grader's ranks have):
  - 2-D: on W ranks, what each rank's grading driver does once torch is imported: the learner's
    parallelize (solutions/32_dtensor_tp.py, or --file yours) on the grader's transformer (a 2-D
    mesh, the tensor-parallel plan, fully_shard over "dp"), then three SGD steps on its group's
    batch. The slowest rank's time, the median over --reps repetitions in the same process group
    (the first one, with the first calls' costs, shown apart);
  - one process: the grader's own dense run of the same steps on every group's batch at once;
  - a warm grading: `ddp-grade` on the file through a warm pool (world sizes 4 and 2 as graded by
    default), timed from the request to the report (--gradings of them, after one that is not
    counted), with the CPU time of the grader and every rank.

    python benchmarks/bench_dtensor_tp.py [--file solutions/32_dtensor_tp.py] [--world-sizes 4 2] [--reps 3]
                                          [--gradings 3]

Not a test: timings depend on the machine, and on what else runs on it (the load average is
printed before and after). Four ranks on two cores share them: what this shows is what a grading
spends where, not what tensor parallelism gains.
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
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fsdp2 import warm_gradings  # noqa: E402  (one way to time a warm grading, for every benchmark)

from grader.rank.drivers import ex32_dtensor_tp as rank_side  # noqa: E402
from grader.checks.ex32_dtensor_tp import reference as ex  # noqa: E402


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graded_steps(learner, rank: int, world_size: int, tp_size: int) -> None:
    model, _ = learner.parallelize(rank_side.build_model(), world_size, tp_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=rank_side.LR)
    for step in range(rank_side.STEPS):
        tokens, targets = rank_side.make_batch(step, rank // tp_size)
        rank_side.train_step(model, optimizer, tokens, targets)


def worker(rank: int, world_size: int, tp_size: int, port: int, reps: int, file: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # The head's output is a view (of the gathered logits): FSDP2 warns about in-place ops on it; none follow.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    importlib.import_module("torch._dynamo")  # as in the warm pool: torch.optim imports it
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    learner = load(Path(file))
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        graded_steps(learner, rank, world_size, tp_size)
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


def one_process(world_size: int, reps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the grader's dense run, medians."""
    torch.set_num_threads(1)
    walls, cpus = [], []
    for _ in range(reps):
        start, cpu = time.perf_counter(), time.process_time()
        ex.reference_run(world_size, rank_side.tp_size_for(world_size))
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=str(ROOT / "solutions" / "32_dtensor_tp.py"))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gradings", type=int, default=3)
    args = parser.parse_args()
    file = str(Path(args.file).resolve())
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; "
          f"{rank_side.STEPS} steps of a {sum(p.numel() for p in rank_side.build_model().parameters())}-parameter "
          f"transformer, {rank_side.BATCH} x {rank_side.SEQ} tokens per data-parallel group")
    print("seconds, wall / CPU (the slowest rank's CPU for the 2-D runs)")
    print(f"{'':>14}" + "".join(f"{title:>19}" for title in ("2-D, 1st run", "2-D, later", "one process")))
    for world_size in args.world_sizes:
        first, later = two_d(world_size, args.reps, file)
        alone = one_process(world_size, args.reps)
        cells = "".join(f"{wall:>11.3f} / {cpu:.3f}" for wall, cpu in (first, later, alone))
        shape = f"{world_size // rank_side.tp_size_for(world_size)}x{rank_side.tp_size_for(world_size)}"
        print(f"{world_size} ranks ({shape})  {cells}  (later 2-D / one process, wall: {later[0] / alone[0]:.1f}x)")
    if args.gradings:
        timed = warm_gradings(file, args.gradings)
        walls, cpus = [w for w, _ in timed], [c for _, c in timed]
        print(f"warm grading (world sizes {' and '.join(map(str, world_sizes()))}): wall "
              f"{', '.join(f'{w:.1f}' for w in walls)} s (median {statistics.median(walls):.1f} s); CPU of the "
              f"grader and every rank {', '.join(f'{c:.1f}' for c in cpus)} s (median {statistics.median(cpus):.1f} s)")
    print(f"load average {os.getloadavg()[0]:.1f}")


def world_sizes() -> tuple[int, ...]:
    from grader import catalog

    return catalog.by_id("32").world_sizes


if __name__ == "__main__":
    main()
