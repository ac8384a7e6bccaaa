"""What exercise 31's grading costs: the graded steps on W ranks beside the same steps in one process.

One run on this machine's CPU, gloo, one compute thread per process (as the grader's ranks have):
  - sharded: on W ranks, what each rank's grading driver does once torch is imported: a 1-D mesh,
    shard_model (solutions/31_fsdp2.py, or --file yours) on the grader's transformer, three
    train_step calls with SGD and gradient clipping, and the full state dict on rank 0
    (get_model_state_dict with full_state_dict and cpu_offload). The slowest rank's time, the
    median over --reps repetitions in the same process group (the first one, with FSDP2's lazy
    initialisation, shown apart);
  - one process: the same three steps with no parallelism, in the same precision: the grader's
    own replay (the model cast to bfloat16 for each rank's batch, gradients averaged in float32,
    clipped, SGD);
  - a warm grading: `ddp-grade` on the file through a warm pool (torch and the checks imported,
    as the grading server keeps them), world sizes 2 and 3 as graded by default, timed from the
    request to the report (--gradings of them, after one that is not counted), with the CPU time
    it took in all (the grader's process and every rank): on a busy machine the wall time says
    little, and the CPU time over the cores bounds what an idle machine would take from below.

    python benchmarks/bench_fsdp2.py [--file solutions/31_fsdp2.py] [--world-sizes 2 3] [--reps 5]
                                     [--gradings 3]

Not a test: timings depend on the machine, and on what else runs on it (the load average is
printed before and after). On one CPU the ranks share the cores, so sharding cannot be faster
than one process here; what it shows is what a grading spends where.
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

from grader.rank.drivers import ex31_fsdp2 as ex  # noqa: E402
from grader.checks.ex31_fsdp2.reference import reference_run  # noqa: E402


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graded_steps(learner, rank: int, world_size: int, mesh) -> None:
    """What the grading driver runs in one rank once torch is imported."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    model = learner.shard_model(ex.build_model(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=ex.LR)
    for step in range(ex.STEPS):
        learner.train_step(model, optimizer, ex.make_batch(step, rank), ex.MAX_NORM)
    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def worker(rank: int, world_size: int, port: int, reps: int, file: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # as in the warm pool: torch.optim imports it
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh

    learner = load(Path(file))
    mesh = init_device_mesh("cpu", (world_size,))
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        graded_steps(learner, rank, world_size, mesh)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    results.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def sharded(world_size: int, reps: int, file: str) -> list[tuple[float, float]]:
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
    """(wall, CPU) seconds of the replay, medians."""
    torch.set_num_threads(1)
    walls, cpus = [], []
    for _ in range(reps):
        start, cpu = time.perf_counter(), time.process_time()
        reference_run(world_size)
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def cpu_seconds() -> float:
    """CPU time of this process and of the warm pool with every rank it has reaped: the forkserver's
    own and its waited-for children's (/proc/PID/stat utime, stime, cutime, cstime)."""
    import resource
    from multiprocessing import forkserver

    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def warm_gradings(file: str, count: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each grading after the first."""
    os.environ.setdefault("DDP_GRADE_SERVER", "0")
    from grader import grading
    from grader.rank import harness
    from grader.grading import GradeOptions, grade_file

    grading.warm_up()
    out = []
    with harness.Session(spares=True) as session:
        for i in range(count + 1):
            start, cpu = time.perf_counter(), cpu_seconds()
            report = grade_file(file, session, GradeOptions())
            if report.status != "passed":
                sys.exit(f"{file} did not pass: {report.status}")
            time.sleep(0.5)  # the forkserver reaps the ranks
            if i:  # the first one waits for the pool to finish importing
                out.append((time.perf_counter() - start - 0.5, cpu_seconds() - cpu))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=str(ROOT / "solutions" / "31_fsdp2.py"))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gradings", type=int, default=3)
    args = parser.parse_args()
    file = str(Path(args.file).resolve())
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; "
          f"{ex.STEPS} steps of a {sum(p.numel() for p in ex.build_model().parameters())}-parameter transformer, "
          f"{ex.BATCH} x {ex.SEQ} tokens per rank")
    print("seconds, wall / CPU (the slowest rank's CPU for the sharded runs)")
    print(f"{'':>9}" + "".join(f"{title:>19}" for title in ("sharded, 1st run", "sharded, later", "one process")))
    for world_size in args.world_sizes:
        first, later = sharded(world_size, args.reps, file)
        alone = one_process(world_size, args.reps)
        cells = "".join(f"{wall:>11.3f} / {cpu:.3f}" for wall, cpu in (first, later, alone))
        print(f"{world_size} ranks  {cells}  (later sharded / one process, wall: {later[0] / alone[0]:.1f}x)")
    if args.gradings:
        timed = warm_gradings(file, args.gradings)
        walls, cpus = [w for w, _ in timed], [c for _, c in timed]
        print(f"warm grading (world sizes {' and '.join(map(str, ex_world_sizes()))}): wall "
              f"{', '.join(f'{w:.1f}' for w in walls)} s (median {statistics.median(walls):.1f} s); CPU of the "
              f"grader and every rank {', '.join(f'{c:.1f}' for c in cpus)} s (median {statistics.median(cpus):.1f} s)")
    print(f"load average {os.getloadavg()[0]:.1f}")


def ex_world_sizes() -> tuple[int, ...]:
    from grader import catalog

    return catalog.by_id("31").world_sizes


if __name__ == "__main__":
    main()
