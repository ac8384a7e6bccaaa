"""What exercise 17's grading costs: the graded forward and backward on W ranks beside the same layer in one process.

One run on this machine's CPU, gloo, one compute thread per process (as the grader's ranks have):
  - on W ranks, the reference ExpertParallelMoE (solutions/17_expert_parallel.py, or --file yours) on the
    grader's router, 12 experts and tokens (float64), each of the graded scenarios: the slowest rank's
    seconds for a forward and backward of sum(y * G) + 0.5 * aux_loss, and the float64 rows each rank
    sent to other ranks per forward (the first all-to-all), beside the rows of its whole batch;
  - one process: the grader's own computation of the same result (ex17_expert_parallel.reference.expected_run: every
    rank's tokens through every expert, forward and backward);
  - a warm grading: `ddp-grade` on the file through a warm pool (world sizes 2, 3 and 4 as graded by
    default), timed from the request to the report (--gradings of them, after one that is not counted),
    with the CPU time of the grader and every rank.

    python benchmarks/bench_expert_parallel.py [--file solutions/17_expert_parallel.py] [--world-sizes 2 4]
                                               [--reps 5] [--gradings 3]

Not a test: timings depend on the machine, and on what else runs on it (the load average is printed
before and after).
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

from grader.rank.drivers import ex17_expert_parallel as ex  # noqa: E402
from grader.checks.ex17_expert_parallel import reference as grader_side  # noqa: E402


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(rank: int, world_size: int, port: int, reps: int, file: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    learner = load(Path(file))
    sent_rows: dict[str, int] = {}
    original = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if input.is_floating_point() and "current" in sent_rows:
            splits = input_split_sizes or [input.shape[0] // world_size] * world_size
            sent_rows["current"] += sum(s for i, s in enumerate(splits) if i != rank) if sent_rows["first"] else 0
            sent_rows["first"] = False
        return original(output, input, output_split_sizes, input_split_sizes, group, async_op)

    dist.all_to_all_single = counted
    seconds: dict[str, list[float]] = {}
    for scenario in ex.SCENARIOS:
        data = ex.build(scenario, world_size)
        layer = learner.ExpertParallelMoE(data["router"], data["experts"], ex.TOP_K, ex.SCENARIOS[scenario][0])
        x, g = data["x"][rank].requires_grad_(True), data["g"][rank]
        seconds[scenario] = []
        for rep in range(reps + 1):
            sent_rows.update(current=0, first=True)
            dist.barrier()
            start = time.perf_counter()
            y, aux = layer(x)
            ((y * g).sum() + ex.AUX_WEIGHT * aux).backward()
            if rep:  # the first repetition pays the first calls' costs
                seconds[scenario].append(time.perf_counter() - start)
        sent_rows[scenario] = sent_rows["current"]
    results.put((rank, {s: statistics.median(v) for s, v in seconds.items()},
                 {s: sent_rows[s] for s in ex.SCENARIOS}))
    dist.barrier()
    dist.destroy_process_group()


def parallel(world_size: int, reps: int, file: str) -> tuple[dict[str, float], dict[str, list[int]]]:
    """The slowest rank's median seconds per scenario, and every rank's rows sent off-rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world_size, port, reps, file, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    got = {}
    while len(got) < world_size:
        try:
            rank, seconds, rows = results.get(timeout=1)
            got[rank] = (seconds, rows)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                sys.exit("a rank failed")
    for p in procs:
        p.join()
    slowest = {s: max(got[r][0][s] for r in got) for s in ex.SCENARIOS}
    rows = {s: [got[r][1][s] for r in sorted(got)] for s in ex.SCENARIOS}
    return slowest, rows


def one_process(world_size: int, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    out = {}
    for scenario in ex.SCENARIOS:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            grader_side.expected_run(scenario, world_size)
            times.append(time.perf_counter() - start)
        out[scenario] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=str(ROOT / "solutions" / "17_expert_parallel.py"))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gradings", type=int, default=3)
    args = parser.parse_args()
    file = str(Path(args.file).resolve())
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; "
          f"{ex.EXPERTS} experts of {ex.D} -> {ex.HIDDEN} -> {ex.D}, top {ex.TOP_K}, {ex.TOKENS} tokens per rank, float64")
    print("milliseconds per forward and backward (the slowest rank), rows sent to other ranks per forward (each rank)")
    for world_size in args.world_sizes:
        seconds, rows = parallel(world_size, args.reps, file)
        alone = one_process(world_size, args.reps)
        for scenario in ex.SCENARIOS:
            print(f"{world_size} ranks, {scenario:>6}: {seconds[scenario] * 1e3:7.2f} ms on the ranks; the grader's "
                  f"one-process reference of all {world_size} ranks' tokens {alone[scenario] * 1e3:7.2f} ms; rows sent "
                  f"{'/'.join(map(str, rows[scenario]))} (a whole batch to every other rank would be "
                  f"{ex.TOKENS * (world_size - 1)})")
    if args.gradings:
        timed = warm_gradings(file, args.gradings)
        walls, cpus = [w for w, _ in timed], [c for _, c in timed]
        print(f"warm grading (world sizes 2, 3, 4): {statistics.median(walls):.2f} s wall (min {min(walls):.2f}), "
              f"{statistics.median(cpus):.2f} s CPU")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
