"""What exercise 33's grading costs: the graded steps and saves on W ranks beside the same steps in one process.

One run on this machine's CPU, gloo, one compute thread per process (as the grader's ranks have):
  - on W ranks (fully_shard on a 1-D mesh, AdamW, the grader's model and global batch), the
    slowest rank's seconds for: the graded steps (8 to 12) with no checkpoint; the same steps with
    the learner's save (solutions/33_dcp.py, or --file yours) after steps 9 and 10, and how long
    each save call kept training waiting; one blocking dcp.save of the same state, for comparison;
    the learner's load of the newest checkpoint on the same ranks;
  - one process: the same steps with no parallelism and no sharding (the whole global batch), and
    one torch.save of its model and optimizer state dicts;
  - a warm grading: `ddp-grade` on the file through a warm pool (world sizes 2, 3 and 4 as graded
    by default), timed from the request to the report (--gradings of them, after one that is not
    counted), with the CPU time of the grader and every rank.

    python benchmarks/bench_dcp.py [--file solutions/33_dcp.py] [--world-sizes 2 3] [--reps 3]
                                   [--gradings 3]

Not a test: timings depend on the machine, and on what else runs on it (the load average is
printed before and after). The disk here is the machine's own (the grader slows it on purpose
for background writes; this benchmark does not).
"""

import argparse
import importlib.util
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_fsdp2 import warm_gradings  # noqa: E402  (one way to time a warm grading, for every benchmark)

from grader.rank.drivers import ex33_dcp as ex  # noqa: E402

STEPS = range(ex.FIRST_STEP, ex.LAST_STEP + 1)


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step(model, optimizer, number: int, rank: int, world_size: int) -> None:
    x, y = ex.batch(number, rank, world_size)
    loss = F.mse_loss(model(x), y, reduction="sum") * world_size / (ex.GLOBAL_BATCH * ex.MLP_OUT)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def new_job(mesh):
    model = ex.shard_model(ex.build_model(), mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=ex.LR, weight_decay=ex.WEIGHT_DECAY)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def worker(rank: int, world_size: int, port: int, reps: int, file: str, folder: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    learner = load(Path(file))
    mesh = init_device_mesh("cpu", (world_size,))
    rows = {"steps": [], "steps with saves": [], "each save call": [], "blocking dcp.save": [], "load": []}
    for rep in range(reps + 1):
        model, optimizer = new_job(mesh)
        plain = timed(lambda: [step(model, optimizer, n, rank, world_size) for n in STEPS])
        model, optimizer = new_job(mesh)
        path = os.path.join(folder, f"w{world_size}-rep{rep}")
        calls = []

        def with_saves():
            for n in STEPS:
                step(model, optimizer, n, rank, world_size)
                if n in ex.RESUME_SAVES:
                    start = time.perf_counter()
                    learner.save(path, model, optimizer, n)
                    calls.append(time.perf_counter() - start)

        saving = timed(with_saves)
        pending = getattr(learner, "pending_save", None)
        if pending is not None:  # the reference keeps its last future here; yours may not
            pending.result()
        dist.barrier()
        state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
        blocking = timed(lambda: dcp.save(state, checkpoint_id=os.path.join(folder, f"blocking-w{world_size}-{rep}")))
        fresh, fresh_optimizer = new_job(mesh)
        loading = timed(lambda: learner.load(path, fresh, fresh_optimizer))
        if rep:  # the first repetition pays FSDP2's and DCP's first-call costs
            for key, value in (("steps", plain), ("steps with saves", saving), ("each save call", max(calls)),
                               ("blocking dcp.save", blocking), ("load", loading)):
                rows[key].append(value)
    results.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def sharded(world_size: int, reps: int, file: str) -> dict[str, float]:
    """The slowest rank's median seconds for each row."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=worker, args=(r, world_size, port, reps, file, folder, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        rows = {}
        while len(rows) < world_size:
            try:
                rank, seconds = results.get(timeout=1)
                rows[rank] = seconds
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    sys.exit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
        for p in procs:
            p.join(timeout=60)
    keys = rows[0].keys()
    return {key: statistics.median(max(rows[r][key][i] for r in rows) for i in range(reps)) for key in keys}


def one_process(reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    steps, saves = [], []
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(reps):
            model = ex.build_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=ex.LR, weight_decay=ex.WEIGHT_DECAY)
            start = time.perf_counter()
            for n in STEPS:
                step(model, optimizer, n, 0, 1)
            steps.append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       os.path.join(folder, "checkpoint.pt"))
            saves.append(time.perf_counter() - start)
    return {"steps": statistics.median(steps), "torch.save": statistics.median(saves)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default=str(ROOT / "solutions" / "33_dcp.py"))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gradings", type=int, default=3)
    args = parser.parse_args()
    file = str(Path(args.file).resolve())
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; "
          f"{len(STEPS)} AdamW steps of a {sum(p.numel() for p in ex.build_model().parameters())}-parameter model, "
          f"global batch {ex.GLOBAL_BATCH}; saves after steps {', '.join(map(str, ex.RESUME_SAVES))}")
    alone = one_process(args.reps)
    print(f"one process: the steps {alone['steps']:.3f} s, torch.save of model and optimizer {alone['torch.save']:.3f} s")
    print("seconds on W ranks, the slowest rank, median over --reps (after one that is not counted)")
    titles = ("steps", "steps with saves", "each save call", "blocking dcp.save", "load")
    print(f"{'':>8}" + "".join(f"{title:>19}" for title in titles))
    for world_size in args.world_sizes:
        row = sharded(world_size, args.reps, file)
        print(f"{world_size} ranks " + "".join(f"{row[title]:>19.3f}" for title in titles)
              + f"   (steps / one process: {row['steps'] / alone['steps']:.1f}x)")
    if args.gradings:
        timed_gradings = warm_gradings(file, args.gradings)
        walls, cpus = [w for w, _ in timed_gradings], [c for _, c in timed_gradings]
        print(f"warm grading (world sizes {' and '.join(map(str, world_sizes()))}): wall "
              f"{', '.join(f'{w:.1f}' for w in walls)} s (median {statistics.median(walls):.1f} s); CPU of the "
              f"grader and every rank {', '.join(f'{c:.1f}' for c in cpus)} s (median {statistics.median(cpus):.1f} s)")
    print(f"load average {os.getloadavg()[0]:.1f}")


def world_sizes() -> tuple[int, ...]:
    from grader import catalog

    return catalog.by_id("33").world_sizes


if __name__ == "__main__":
    main()
