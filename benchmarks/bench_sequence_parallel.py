"""What exercise 18's grading costs: the graded block on W ranks beside the dense block in one process.

One run on this machine's CPU, gloo, float64, one compute thread per process (as the grader's ranks have):
  - on W ranks: what each rank's grading driver does with the block once torch is imported: build
    SequenceParallelBlock (solutions/18_sequence_parallel.py, or --file yours) from the grader's dense
    modules, forward on its chunk of the grader's sequence and backward of sum(output * G). The slowest
    rank's time, the median over --reps repetitions in the same process group (the first one shown
    apart), with the collectives rank 0 calls in forward and in backward (each with the bytes of
    the tensor it is given: the whole sequence for an all-gather's output), and what autograd saves
    outside the parallel region (as the grader sorts it) beside what the dense block saves there;
  - one process: the dense block, x + fc2(gelu(fc1(norm(x)))), forward and backward on the whole sequence;
  - a warm grading: `ddp-grade` on the file through a warm pool (world sizes 2, 3 and 4 as graded by
    default), timed from the request to the report (--gradings of them, after one that is not counted),
    with the CPU time of the grader and every rank.

    python benchmarks/bench_sequence_parallel.py [--file solutions/18_sequence_parallel.py]
                                                 [--world-sizes 2 3 4] [--reps 5] [--gradings 3]

Not a test: timings depend on the machine, and on what else runs on it (the load average is printed
before and after). The block is the grader's, a few kilobytes: what the figures show is where a grading's
time goes (process groups and collectives, not arithmetic), not how sequence parallelism scales.
"""

import argparse
import importlib.util
import io
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

from grader.rank import probes  # noqa: E402
from grader.rank.drivers import ex18_sequence_parallel as rk  # noqa: E402
from grader.checks.ex18_sequence_parallel import reference as ex  # noqa: E402
from grader.checks.ex18_sequence_parallel.verdicts import rank_saved  # noqa: E402


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graded_block(learner, rank: int, world_size: int, events: list | None = None,
                 saved: "rk.SavedTensors | None" = None) -> None:
    """What the grading driver runs with the block in one rank (the main scenario)."""
    data = rk.build("main", *rk.sizes(world_size))
    block = learner.SequenceParallelBlock(data["norm"], data["fc1"], data["fc2"])
    rows = rk.chunk_rows(rank, world_size, data["x"].shape[0])
    x = data["x"][rows].clone().requires_grad_(True)
    first = len(events) if events is not None else 0
    if saved is not None:
        with saved.hooks():
            y = block(x)
    else:
        y = block(x)
    forward = len(events) if events is not None else 0
    (y * data["g"][rows]).sum().backward()
    if events is not None:
        for e in events[first:forward]:
            e["phase"] = "forward"
        for e in events[forward:]:
            e["phase"] = "backward"


def worker(rank: int, world_size: int, port: int, reps: int, file: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    learner = load(Path(file))
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        graded_block(learner, rank, world_size)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    events: list = []
    saved = rk.SavedTensors([])
    with probes.watch_collectives(events):
        graded_block(learner, rank, world_size, events, saved)
    record = io.BytesIO()  # as bytes: tensors through a queue would share memory the rank frees on exit
    torch.save((times, events, saved.record()), record)
    results.put((rank, record.getvalue()))
    dist.barrier()
    dist.destroy_process_group()


def sharded(world_size: int, reps: int, file: str) -> dict:
    """The slowest rank's (wall, CPU) seconds, first run and median of the later ones; rank 0's traffic and saves."""
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
            rank, record = results.get(timeout=1)
            got[rank] = torch.load(io.BytesIO(record), weights_only=False)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                sys.exit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join(timeout=60)
    walls = [max(got[r][0][i][0] for r in got) for i in range(reps + 1)]
    cpus = [max(got[r][0][i][1] for r in got) for i in range(reps + 1)]
    return {"first": (walls[0], cpus[0]), "later": (statistics.median(walls[1:]), statistics.median(cpus[1:])),
            "events": got[0][1], "saved": got[0][2]}


def one_process(reps: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the dense block's forward and backward, medians."""
    torch.set_num_threads(1)
    walls, cpus = [], []
    for _ in range(reps + 1):
        start, cpu = time.perf_counter(), time.process_time()
        ex.dense(rk.build("main", *rk.sizes(2)))
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls[1:]), statistics.median(cpus[1:])


def traffic(events: list[dict], phase: str) -> str:
    mine = [e for e in events if e.get("phase") == phase]
    return f"{len(mine)} calls, {sum(e['bytes'] for e in mine)} B of tensors given (" + \
        ", ".join(f"{e['op']} {e['bytes']}" for e in mine) + ")"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=str(ROOT / "solutions" / "18_sequence_parallel.py"))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gradings", type=int, default=3)
    args = parser.parse_args()
    file = str(Path(args.file).resolve())
    dense_outside = ex.outside_bytes_dense(ex.expected_main(2))
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; the grader's block: "
          f"seq {rk.SEQ}, batch {rk.BATCH}, d {rk.D_MODEL}, hidden {rk.HIDDEN} (on 2, 3 or 4 ranks), float64")
    alone = one_process(args.reps)
    print(f"one process, dense block forward + backward: {alone[0] * 1e3:.2f} ms wall / {alone[1] * 1e3:.2f} ms CPU; "
          f"saves {dense_outside} B outside the parallel region")
    print("W ranks, forward + backward (the slowest rank), ms wall / CPU:")
    for world_size in args.world_sizes:
        run = sharded(world_size, args.reps, file)
        want = ex.expected_main(world_size)
        dense_outside = ex.outside_bytes_dense(want)
        entries = rank_saved({"main": run}, want, 0, world_size)
        outside = sum(e["bytes"] for e in entries if e["kind"] == "outside")
        (w1, c1), (w2, c2) = run["first"], run["later"]
        print(f"  {world_size} ranks: 1st {w1 * 1e3:.2f} / {c1 * 1e3:.2f}, later {w2 * 1e3:.2f} / {c2 * 1e3:.2f} "
              f"({w2 / alone[0]:.1f}x one process); rank 0 saves {outside} B outside the region "
              f"(1/{world_size} of the dense block's is {dense_outside // world_size})")
        print(f"     rank 0's collectives, forward: {traffic(run['events'], 'forward')}")
        print(f"     rank 0's collectives, backward: {traffic(run['events'], 'backward')}")
    if args.gradings:
        timed = warm_gradings(file, args.gradings)
        walls, cpus = [w for w, _ in timed], [c for _, c in timed]
        print(f"warm grading (world sizes 2, 3 and 4, and the uneven run on 4): wall "
              f"{', '.join(f'{w:.1f}' for w in walls)} s (median {statistics.median(walls):.1f} s); CPU of the "
              f"grader and every rank {', '.join(f'{c:.1f}' for c in cpus)} s (median {statistics.median(cpus):.1f} s)")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
