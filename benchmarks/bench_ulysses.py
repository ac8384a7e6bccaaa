"""Exercise 20's Ulysses attention beside the same attention in one process, and beside 16's ring.

Two parts, one run on this machine's CPU (gloo):
  1. the grading: warm gradings of solutions/20_ulysses.py (a warm process pool, as `ddp-grade watch`
     and the grading server keep one), beside the same work without parallelism: the forward and
     backward of every graded scenario (float64, at each graded world size) computed in one process;
  2. at a size where compute shows (--seq positions, batch 1, --heads heads of --head-dim, float32):
     forward and backward in one process (torch.nn.functional.scaled_dot_product_attention), with
     ulysses_attention (solutions/20_ulysses.py) on W ranks and with ring_attention
     (solutions/16_ring_attention.py) on the same W ranks, non-causal and causal. For each: the
     median step (for the ranks: the slowest rank's), the CPU time of the least and the most loaded
     rank, and the bytes a rank sends per step (all-to-alls: what leaves the rank; ring: dist.isend).
Every process computes with one thread (--threads), so that W ranks use W cores where one process
uses one.

    python benchmarks/bench_ulysses.py [--gradings 3] [--seq 2048] [--heads 8] [--head-dim 64] [--world-sizes 2 4]

Not a test: timings depend on the machine. On a 2-core CPU the ranks share cores, and gloo's messages
go through the kernel, so neither method is faster than one process here. What the second part shows
is the traffic each method pays per step (Ulysses 8 (W - 1) / W chunks, the ring 6W - 4 blocks of K or
V) and the causal balance: every Ulysses rank does the same work, where a contiguous ring's last rank
does W times the first's.
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import warm
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP = 2
CORES = os.cpu_count() or 2


def load(relative_path: str):
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- 1. the grading ----------------------------------------------------------------------------------


def graded_work_in_one_process(world_sizes) -> float:
    """Seconds one process takes for the forward and backward of every scenario the grading runs."""
    from grader.rank.drivers import ex20_ulysses as ex_rank
    from grader.checks.ex20_ulysses.reference import attention

    start = time.perf_counter()
    for world_size in world_sizes:
        scenarios = ["plain", "causal", "gqa", "few-kv"] + (["group"] if world_size == max(world_sizes) else [])
        for scenario in scenarios:
            data = ex_rank.make_inputs(scenario, world_size)
            q, k, v = (data[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
            (attention(q, k, v, ex_rank.shapes(scenario, world_size)[2]) * data["g"]).sum().backward()
    return time.perf_counter() - start


def gradings(count: int) -> None:
    from grader import catalog

    world_sizes = catalog.by_id("20").world_sizes
    first, later = warm.gradings(ROOT / "solutions" / "20_ulysses.py", count)
    alone = statistics.median(graded_work_in_one_process(world_sizes) for _ in range(3))
    print(f"warm gradings of solutions/20_ulysses.py (world sizes {', '.join(map(str, world_sizes))} and the two "
          f"refusals at once): first {first:.2f} s, later (median of {count}) {later:.2f} s")
    print(f"the same attention, forward and backward of every graded scenario, in one process: {alone * 1e3:.1f} ms\n")


# --- 2. at a size where compute shows --------------------------------------------------------------


def make_inputs(seq: int, heads: int, head_dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, seq, head_dim, generator=g) for _ in range(4)]  # q, k, v, output gradient


def step(attention, q, k, v, g) -> None:
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    (attention(q, k, v) * g).sum().backward()


def median_time(attention, tensors, reps: int, sync) -> tuple[float, float]:
    """Median seconds of a forward and backward: wall time, and this process's CPU time."""
    seconds, cpu = [], []
    for i in range(WARMUP + reps):
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        step(attention, *tensors)
        if i >= WARMUP:
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return statistics.median(seconds), statistics.median(cpu)


class SentBytes:
    """Counts the bytes this rank sends: what leaves it in each dist.all_to_all_single ((W - 1) / W of the
    input, with equal splits), and what it hands to dist.isend. Replaced in distributed_c10d too, where
    dist.P2POp and dist.batch_isend_irecv look isend up."""

    def __enter__(self):
        self.isend, self.all_to_all, self.bytes = dist.isend, dist.all_to_all_single, 0

        def isend(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self.isend(tensor, *args, **kwargs)

        def all_to_all_single(output, tensor, *args, **kwargs):
            size = dist.get_world_size(kwargs.get("group"))
            self.bytes += tensor.numel() * tensor.element_size() * (size - 1) // size
            return self.all_to_all(output, tensor, *args, **kwargs)

        dist.isend = dist.distributed_c10d.isend = isend
        dist.all_to_all_single = all_to_all_single
        return self

    def __exit__(self, *exc):
        dist.isend = dist.distributed_c10d.isend = self.isend
        dist.all_to_all_single = self.all_to_all


def worker(rank, world_size, port, args, results) -> None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    ulysses, ring = load("solutions/20_ulysses.py"), load("solutions/16_ring_attention.py")
    whole = make_inputs(args.seq, args.heads, args.head_dim)
    chunk = args.seq // world_size
    mine = [t[:, :, rank * chunk:(rank + 1) * chunk].contiguous() for t in whole]
    runs = {
        "ulysses_attention": lambda q, k, v: ulysses.ulysses_attention(q, k, v),
        "ulysses_attention causal": lambda q, k, v: ulysses.ulysses_attention(q, k, v, causal=True),
        "ring_attention": lambda q, k, v: ring.ring_attention(q, k, v),
        "ring_attention causal": lambda q, k, v: ring.ring_attention(q, k, v, causal=True),
    }
    for label, attention in runs.items():
        with SentBytes() as sent:
            step(attention, *mine)
        seconds, cpu = median_time(attention, mine, args.reps, dist.barrier)
        results.put((label, world_size, rank, seconds, cpu, sent.bytes))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world_size: int, args) -> list[tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(worker, args=(world_size, store.port, args, results), nprocs=world_size, join=True,
                       start_method="spawn")
    return [results.get() for _ in range(4 * world_size)]


def scaling(args) -> None:
    torch.set_num_threads(args.threads)
    whole = make_inputs(args.seq, args.heads, args.head_dim)
    rows = []
    for causal in (False, True):
        seconds, cpu = median_time(lambda q, k, v, causal=causal: F.scaled_dot_product_attention(
            q, k, v, is_causal=causal), whole, args.reps, lambda: None)
        rows.append((f"1 process, F.sdpa{' causal' if causal else ''}", seconds, (cpu, cpu), 0))
    for world_size in args.world_sizes:
        measured = run_world(world_size, args)
        for label in ("ulysses_attention", "ulysses_attention causal", "ring_attention", "ring_attention causal"):
            mine = [m for m in measured if m[0] == label]
            cpu = [m[4] for m in mine]
            rows.append((f"{label}, {world_size} ranks", max(m[3] for m in mine), (min(cpu), max(cpu)),
                         max(m[5] for m in mine)))
    chunk = args.heads * args.seq * args.head_dim * 4
    print(f"attention over {args.seq} positions, 1 x {args.heads} heads x {args.head_dim}, float32, gloo, "
          f"{args.threads} thread(s) per process on {CORES} CPU core(s); median of {args.reps} forward+backward "
          f"steps after {WARMUP} warm-up\n")
    print(f"{'':40}{'step':>10}{'CPU per rank':>22}{'sent/rank/step':>16}")
    for label, seconds, (least, most), sent in rows:
        spread = f"{least * 1e3:.1f}-{most * 1e3:.1f}ms" if most > least else f"{most * 1e3:.1f}ms"
        print(f"{label:40}{seconds * 1e3:>8.1f}ms{spread:>22}{sent / 2**20:>13.2f}MiB")
    print(f"\nq, k, v and the output of the whole sequence are {chunk / 2**20:.2f} MiB each, a rank's chunk 1/W of "
          "that. Per step a Ulysses rank sends (W - 1) / W of 8 chunks (q, k, v, the output; their gradients); a "
          "ring rank sends 6W - 4 blocks (K and V W - 1 times in forward, again in backward, their gradients W "
          "times): over a step twice Ulysses' bytes at W = 2, 3.3 times at W = 4 (forwards alone: equal at W = 2).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gradings", type=int, default=3, help="warm gradings after the first (0: skip part 1)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (divisible by each world size)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (divisible by each world size)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=5, help="timed forward+backward steps (after a warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads in each process")
    args = parser.parse_args()
    for world_size in args.world_sizes:
        if args.seq % world_size or args.heads % world_size:
            parser.error(f"--seq {args.seq} and --heads {args.heads} must be divisible by {world_size}")
    print(f"{CORES} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}\n")
    if args.gradings:
        gradings(args.gradings)
    scaling(args)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
