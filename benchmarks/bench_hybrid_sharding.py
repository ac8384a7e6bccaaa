"""Exercise 36's hybrid sharding and recovery from a peer, beside the same work in one process.

Two parts, one run on this machine's CPU (gloo):
  1. the grading: warm gradings of solutions/36_hybrid_recovery.py (a warm process pool, as `ddp-grade watch`
     and the grading server keep one), beside the same work without parallelism: the graded training
     (every rank's batches, AdamW, the steps before and after the failure) in one process, and the copy of
     one rank's state that a recovery amounts to in one process;
  2. at a size where bytes show (--dim, --blocks; float32): on 4 ranks, 2 replicas x 2 shards, the median
     training step of shard_hybrid's model and the recovery of replica 0 from replica 1 with
     recover_from_peer (solutions/36_hybrid_recovery.py), beside the same recovery through a checkpoint
     (each source rank torch.save's its local state to a file, its wiped peer torch.load's it and copies it
     in), and beside one process training the unsharded model on the global batch. For each: the slowest
     rank's wall time and the bytes a rank sends or writes.
Every process computes with one thread (--threads).

    python benchmarks/bench_hybrid_sharding.py [--gradings 3] [--dim 512] [--blocks 4] [--reps 5]

Not a test: timings depend on the machine. On a 2-core CPU the four ranks share the cores. What the second
part shows: a recovery sends exactly each rank's state (1 / shards of the model and of its AdamW state),
and a checkpoint writes the same bytes and reads them back.
"""

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import warm
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP = 1
REPLICAS, SHARDS = 2, 2
BATCH = 16  # rows per rank


def load(relative_path: str):
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- 1. the grading ----------------------------------------------------------------------------------


def graded_work_in_one_process(world_sizes) -> float:
    """Seconds one process takes for the training every graded job runs, and a copy of one rank's state."""
    import math

    from grader.checks.ex36_hybrid_recovery.reference import reference_run, shapes

    elements = sum(math.prod(shape) for shape in shapes().values())
    start = time.perf_counter()
    for world_size in world_sizes:
        reference_run(world_size)
        state = [torch.randn(elements, dtype=torch.float64) for _ in range(3)]  # parameters and AdamW's moments
        copies = [torch.empty_like(t) for t in state]
        for target, value in zip(copies, state):
            target.copy_(value)
    return time.perf_counter() - start


def gradings(count: int) -> None:
    from grader import catalog

    world_sizes = catalog.by_id("36").world_sizes
    first, later = warm.gradings(ROOT / "solutions" / "36_hybrid_recovery.py", count)
    alone = statistics.median(graded_work_in_one_process(world_sizes) for _ in range(3))
    print(f"warm gradings of solutions/36_hybrid_recovery.py (world sizes {', '.join(map(str, world_sizes))}, one "
          f"after the other): first {first:.2f} s, later (median of {count}) {later:.2f} s")
    print(f"the same training (every rank's batches, AdamW) and a copy of a rank's state, in one process: "
          f"{alone * 1e3:.1f} ms\n")


# --- 2. at a size where bytes show -------------------------------------------------------------------


def build(solution, args):
    torch.manual_seed(0)
    return solution.Model(d_in=args.dim, dim=args.dim, hidden=4 * args.dim, n_blocks=args.blocks, d_out=args.dim)


def batch(step: int, rank: int, args):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, args.dim, generator=g), torch.randn(BATCH, args.dim, generator=g)


def train_step(model, optimizer, step: int, rank: int, args) -> None:
    x, y = batch(step, rank, args)
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def local_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def checkpoint_recovery(solution, model, optimizer, source_replica: int, folder: str) -> int:
    """The slow path: the source writes its local state, its wiped peer reads it. Returns the bytes written."""
    replica, shard = dist.get_rank() // SHARDS, dist.get_rank() % SHARDS
    tensors = solution.local_state(model, optimizer)
    path = os.path.join(folder, f"shard{shard}.pt")
    written = 0
    if replica == source_replica:
        torch.save([t.detach() for t in tensors], path)
        written = os.path.getsize(path)
    dist.barrier()
    if replica != source_replica:
        with torch.no_grad():
            for tensor, value in zip(tensors, torch.load(path)):
                tensor.copy_(value)
    dist.barrier()
    return written


def worker(rank, port, folder, args, results) -> None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=REPLICAS * SHARDS)
    solution = load("solutions/36_hybrid_recovery.py")
    model, mesh = solution.shard_hybrid(build(solution, args), REPLICAS, SHARDS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for step in range(WARMUP + args.reps):
        dist.barrier()
        start = time.perf_counter()
        train_step(model, optimizer, step, rank, args)
        if step >= WARMUP:
            steps.append(time.perf_counter() - start)
    sent = [0]
    real_send = dist.send

    def send(tensor, *a, **k):
        sent[0] += tensor.numel() * tensor.element_size()
        return real_send(tensor, *a, **k)

    peer, written = [], []
    for rep in range(args.reps):
        dist.barrier()
        start = time.perf_counter()
        dist.send = send
        try:
            solution.recover_from_peer(model, optimizer, mesh, source_replica=1)
        finally:
            dist.send = real_send
        peer.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        size = checkpoint_recovery(solution, model, optimizer, 1, folder)
        written.append(time.perf_counter() - start)
    results.put((rank, statistics.median(steps), statistics.median(peer), statistics.median(written),
                 sent[0] // args.reps, size, local_bytes(solution.local_state(model, optimizer))))
    dist.barrier()
    dist.destroy_process_group()


def scaling(args) -> None:
    torch.set_num_threads(args.threads)
    solution = load("solutions/36_hybrid_recovery.py")
    model = build(solution, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(WARMUP + args.reps):
        start = time.perf_counter()
        for rank in range(REPLICAS * SHARDS):  # the global batch, one rank's rows at a time
            x, y = batch(step, rank, args)
            (F.mse_loss(model(x), y) / (REPLICAS * SHARDS)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(worker, args=(store.port, folder, args, results), nprocs=REPLICAS * SHARDS, join=True,
                           start_method="spawn")
        measured = sorted(results.get() for _ in range(REPLICAS * SHARDS))
    print(f"a model of {args.blocks} blocks of width {args.dim} ({whole / 2**20:.1f} MiB of float32 parameters, "
          f"{3 * whole / 2**20:.1f} MiB with AdamW's moments), {REPLICAS} replicas x {SHARDS} shards on gloo, "
          f"{args.threads} thread(s) per process; medians of {args.reps} after {WARMUP} warm-up\n")
    print(f"{'':52}{'wall':>10}{'bytes a rank moves':>22}")
    print(f"{'1 process, a step on the global batch':52}{statistics.median(times) * 1e3:>8.1f}ms{'-':>22}")
    print(f"{'shard_hybrid, a step (slowest rank)':52}{max(m[1] for m in measured) * 1e3:>8.1f}ms{'-':>22}")
    sent = max(m[4] for m in measured)
    print(f"{'recover_from_peer (slowest rank)':52}{max(m[2] for m in measured) * 1e3:>8.1f}ms"
          f"{sent / 2**20:>18.2f}MiB")
    print(f"{'the same state through a checkpoint file':52}{max(m[3] for m in measured) * 1e3:>8.1f}ms"
          f"{max(m[5] for m in measured) / 2**20:>18.2f}MiB")
    state = max(m[6] for m in measured)
    print(f"\neach rank's local state (its shard of every parameter, exp_avg, exp_avg_sq, step counts) is "
          f"{state / 2**20:.2f} MiB, 1/{SHARDS} of the model's {3 * whole / 2**20:.1f} MiB: a source rank sends "
          f"exactly that ({sent} bytes against {state}); the file holds it and torch.save's description.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gradings", type=int, default=3)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.gradings:
        gradings(args.gradings)
    scaling(args)


if __name__ == "__main__":
    main()
