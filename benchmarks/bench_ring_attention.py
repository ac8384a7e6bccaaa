"""The ring attention of exercise 16 beside attention computed in one process.

One run on this machine's CPU, gloo, float32: attention over a sequence of --seq positions
(batch 1, --heads heads of --head-dim), forward and backward. Side by side:
  - one process, the whole sequence: softmax(q k^T / sqrt(d)) v written out (the whole score
    matrix in memory), and torch.nn.functional.scaled_dot_product_attention (torch's fused kernel);
  - ring_attention (solutions/16_ring_attention.py) on W ranks, each holding seq / W positions,
    non-causal and causal, and zigzag_ring_attention (causal, load-balanced).
For each: the median time of a forward and backward (for the ring: the slowest rank's), the CPU
time it takes on the least and the most loaded rank (which shows how even the work is: with causal
contiguous chunks the last rank works W times as long as the first), the largest score matrix one
process holds, and the bytes each rank sends per step (counted by wrapping dist.isend).
Every process computes with one thread by default (--threads), so that W ranks use W cores where
the single process uses one.

    python benchmarks/bench_ring_attention.py [--seq 2048] [--heads 4] [--head-dim 64] [--world-sizes 2 4] [--reps 5]

Not a test: timings depend on the machine. On one CPU the ranks share cores and memory bandwidth,
and gloo's messages go through the kernel, so the ring is not faster here; what it shows is the
per-rank memory (a 1/W^2 share of the score matrix, 1/W of K and V at a time) and the traffic paid
for it, and that causal contiguous chunks load the last rank W times more than the first.
"""

import argparse
import importlib.util
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 2
CORES = os.cpu_count() or 2


def load(relative_path: str):
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(seq: int, heads: int, head_dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, seq, head_dim, generator=g) for _ in range(4)]  # q, k, v, output gradient


def written_out(q, k, v, causal):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def fused(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def step(attention, q, k, v, g) -> None:
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    (attention(q, k, v) * g).sum().backward()


def median_time(attention, tensors, reps: int, sync) -> tuple[float, float]:
    """Median seconds of a forward and backward: wall time, and this process's CPU time (a rank that waits
    for its neighbours spends wall time but no CPU time)."""
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
    """Counts the bytes this rank hands to dist.isend (what the reference solution sends with). Replaced in
    distributed_c10d too, where dist.P2POp and dist.batch_isend_irecv look it up."""

    def __enter__(self):
        self.original, self.bytes = dist.isend, 0

        def isend(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self.original(tensor, *args, **kwargs)

        dist.isend = dist.distributed_c10d.isend = isend
        return self

    def __exit__(self, *exc):
        dist.isend = dist.distributed_c10d.isend = self.original


def zigzag_rows(rank: int, world_size: int, seq: int) -> torch.Tensor:
    half = seq // (2 * world_size)
    late = 2 * world_size - 1 - rank
    return torch.cat([torch.arange(rank * half, (rank + 1) * half), torch.arange(late * half, (late + 1) * half)])


def worker(rank, world_size, port, args, results) -> None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    solution = load("solutions/16_ring_attention.py")
    whole = make_inputs(args.seq, args.heads, args.head_dim)
    chunk = args.seq // world_size
    contiguous = [t[:, :, rank * chunk:(rank + 1) * chunk].contiguous() for t in whole]
    zigzag = [t[:, :, zigzag_rows(rank, world_size, args.seq)].contiguous() for t in whole]
    runs = {
        "ring_attention": (lambda q, k, v: solution.ring_attention(q, k, v), contiguous),
        "ring_attention causal": (lambda q, k, v: solution.ring_attention(q, k, v, causal=True), contiguous),
        "zigzag_ring_attention": (solution.zigzag_ring_attention, zigzag),
    }
    for label, (attention, tensors) in runs.items():
        with SentBytes() as sent:
            step(attention, *tensors)
        seconds, cpu = median_time(attention, tensors, args.reps, dist.barrier)
        results.put((label, world_size, rank, seconds, cpu, sent.bytes))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world_size: int, args) -> list[tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(worker, args=(world_size, store.port, args, results), nprocs=world_size, join=True,
                       start_method="spawn")
    return [results.get() for _ in range(3 * world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (divisible by 2 * each world size)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=5, help="timed forward+backward steps (after a warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads in each process")
    args = parser.parse_args()
    for world_size in args.world_sizes:
        if args.seq % (2 * world_size):
            parser.error(f"--seq {args.seq} is not divisible by 2 x {world_size}")

    torch.set_num_threads(args.threads)
    whole = make_inputs(args.seq, args.heads, args.head_dim)
    def score_bytes(n: int) -> int:  # float32 scores of n queries by n keys, every head
        return args.heads * n * n * 4

    rows = []
    for causal in (False, True):
        for name, attention in (("written out", written_out), ("F.sdpa", fused)):
            def one_process(q, k, v, attention=attention, causal=causal):
                return attention(q, k, v, causal)

            seconds, cpu = median_time(one_process, whole, args.reps, lambda: None)
            label = f"1 process, {name}{' causal' if causal else ''}"
            rows.append((label, seconds, (cpu, cpu), score_bytes(args.seq) if name == "written out" else None, 0))
    for world_size in args.world_sizes:
        measured = run_world(world_size, args)
        for label in ("ring_attention", "ring_attention causal", "zigzag_ring_attention"):
            mine = [m for m in measured if m[0] == label]
            cpu = [m[4] for m in mine]
            block = args.seq // world_size
            rows.append((f"{label}, {world_size} ranks", max(m[3] for m in mine), (min(cpu), max(cpu)),
                         score_bytes(block), max(m[5] for m in mine)))

    kv_bytes = 2 * args.heads * args.seq * args.head_dim * 4
    print(f"attention over {args.seq} positions, 1 x {args.heads} heads x {args.head_dim}, float32, gloo, "
          f"{args.threads} thread(s) per process on {CORES} CPU core(s); median of {args.reps} forward+backward "
          f"steps after {WARMUP} warm-up\n")
    print(f"{'':38}{'step':>10}{'CPU per rank':>20}{'largest scores':>16}{'sent/rank/step':>16}")
    for label, seconds, (least, most), scores, sent in rows:
        cpu = f"{least * 1e3:.1f}-{most * 1e3:.1f}ms" if most > least else f"{most * 1e3:.1f}ms"
        held = f"{scores / 2**20:>13.2f}MiB" if scores is not None else f"{'(fused)':>16}"
        print(f"{label:38}{seconds * 1e3:>8.1f}ms{cpu:>20}{held}{sent / 2**20:>13.2f}MiB")
    print(f"\nK and V of the whole sequence are {kv_bytes / 2**20:.2f} MiB, a rank's block of K or of V 1/(2W) of "
          "that. Per step a rank sends 6W - 4 blocks: K and V W - 1 times in forward, and in backward K and V "
          "W - 1 times again and their gradients W times.")


if __name__ == "__main__":
    main()
