"""Hiding communication (exercises 51 and 53): each step with its communication overlapped, beside the same step
waiting for it at once, in one run on this machine's CPU (gloo).

Three parts:
  1. the gradings: warm gradings of solutions/51_prefetch_fsdp.py and solutions/53_async_tp.py (a warm process
     pool, as `ddp-grade watch` and the grading server keep one);
  2. 51 at a size where compute shows (--units Linear layers of --width, batch --batch, float32, W ranks): a
     training step of the reference PrefetchingFSDP (the next unit's all-gather issued before this unit computes,
     reduce-scatters waited for at the end), of the same class waiting for each all-gather as soon as it is issued
     (tests/variants/51_waits_at_once.py) and of exercise 11's FullyShardedDP (solutions/11_fsdp.py);
  3. 53 at such a size (--rows rows of --features, W ranks): allgather_matmul and matmul_reduce_scatter (the
     reference's rings, forward and backward) beside all_gather_single then a matmul, and a matmul then
     reduce_scatter_single (their backward the reduce-scatter and the all-gather).
For each: the median step or call (the slowest rank's), and the median time a rank spent inside Work.wait() and
blocking collectives per step: the communication the computation did not hide. Every process computes with one
thread (--threads).

    python benchmarks/bench_overlap.py [--gradings 3] [--world-sizes 2 4] [--units 8] [--width 1024]

Not a test: timings depend on the machine. On 2 shared CPU cores gloo's transfers and the matmuls compete for the
same cores, so overlap shortens a step little or not at all here; the time spent waiting shows how much of the
communication was left exposed. On GPUs the transfers run on the network and copy engines while the SMs compute.
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import warm

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


# --- 1. the gradings ---------------------------------------------------------------------------------------


def gradings(count: int) -> None:
    for name in ("51_prefetch_fsdp.py", "53_async_tp.py"):
        first, later = warm.gradings(ROOT / "solutions" / name, count)
        print(f"warm gradings of solutions/{name}: first {first:.2f} s, later (median of {count}) {later:.2f} s")
    print()


# --- the time spent waiting ---------------------------------------------------------------------------------


class Waiting:
    """Seconds this rank spends inside Work.wait() and inside the blocking collectives and sends (the time the
    step stood still for communication)."""

    BLOCKING = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
                "all_reduce", "send", "recv")

    def __enter__(self):
        self.seconds, self.saved, self.depth = 0.0, {}, 0

        def timed(original):
            # Counted once, at the outermost call: a blocking collective waits on its own Work, and the deprecated
            # names (all_gather_into_tensor) call the new ones.
            def call(*args, **kwargs):
                start = time.perf_counter()
                self.depth += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    self.depth -= 1
                    if self.depth == 0 and not kwargs.get("async_op"):
                        self.seconds += time.perf_counter() - start
            return call

        for name in self.BLOCKING:
            self.saved[name] = getattr(dist, name)
            setattr(dist, name, timed(self.saved[name]))
        self.saved["wait"] = dist.Work.wait
        dist.Work.wait = timed(self.saved["wait"])
        return self

    def __exit__(self, *exc):
        dist.Work.wait = self.saved.pop("wait")
        for name, original in self.saved.items():
            setattr(dist, name, original)


def median_step(step, reps: int) -> tuple[float, float]:
    """Median seconds of ``step()``, and of the time spent waiting in it."""
    seconds, waited = [], []
    for i in range(WARMUP + reps):
        dist.barrier()
        with Waiting() as waiting:
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
        if i >= WARMUP:
            seconds.append(elapsed)
            waited.append(waiting.seconds)
    return statistics.median(seconds), statistics.median(waited)


# --- 2. 51 ----------------------------------------------------------------------------------------------------


def fsdp_runs(rank: int, args) -> dict:
    runs = {"PrefetchingFSDP (51, the reference)": load("solutions/51_prefetch_fsdp.py").PrefetchingFSDP,
            "the same, each all-gather waited for at once": load("tests/variants/51_waits_at_once.py").PrefetchingFSDP,
            "FullyShardedDP (11)": load("solutions/11_fsdp.py").FullyShardedDP}
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=generator)
    y = torch.randn(args.batch, args.width, generator=generator)
    out = {}
    for label, cls in runs.items():
        torch.manual_seed(0)
        model = cls(torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.units)]))

        def step():
            F.mse_loss(model(x), y).backward()
            model.finish_gradient_synchronization()
            for p in model.parameters():
                p.grad = None

        out[label] = median_step(step, args.reps)
    return out


# --- 3. 53 ----------------------------------------------------------------------------------------------------


def tp_runs(rank: int, world_size: int, args) -> dict:
    ring = load("solutions/53_async_tp.py")
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(rank)
    rows, features = args.rows // world_size, args.features
    x_shard = torch.randn(rows, features, generator=generator)
    weight = torch.randn(features, features // world_size, generator=generator)
    x_full = torch.randn(rows * world_size, features // world_size, generator=generator)
    weight_rows = torch.randn(features // world_size, features, generator=generator)

    def gather_then_matmul(x, w, group):
        gathered = x.new_empty(x.shape[0] * world_size, x.shape[1])
        dist.all_gather_single(gathered, x.detach(), group=group)
        return _GatheredMatmul.apply(x, w, gathered, group)

    def matmul_then_reduce_scatter(x, w, group):
        return _MatmulScattered.apply(x, w, group)

    runs = {"allgather_matmul (53, the ring)": (ring.allgather_matmul, x_shard, weight),
            "all_gather_single, then matmul": (gather_then_matmul, x_shard, weight),
            "matmul_reduce_scatter (53, the ring)": (ring.matmul_reduce_scatter, x_full, weight_rows),
            "matmul, then reduce_scatter_single": (matmul_then_reduce_scatter, x_full, weight_rows)}
    out = {}
    for label, (function, x, w) in runs.items():
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def call():
            function(x, w, group).sum().backward()

        out[label] = median_step(call, args.reps)
    return out


class _GatheredMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, gathered, group):
        ctx.save_for_backward(gathered, weight)
        ctx.group = group
        return gathered @ weight

    @staticmethod
    def backward(ctx, grad):
        gathered, weight = ctx.saved_tensors
        partial = grad @ weight.t()
        grad_x = partial.new_empty(partial.shape[0] // dist.get_world_size(ctx.group), partial.shape[1])
        dist.reduce_scatter_single(grad_x, partial, group=ctx.group)
        return grad_x, gathered.t() @ grad, None, None


class _MatmulScattered(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        product = x @ weight
        out = product.new_empty(product.shape[0] // dist.get_world_size(group), product.shape[1])
        dist.reduce_scatter_single(out, product, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathered = grad.new_empty(x.shape[0], grad.shape[1])
        dist.all_gather_single(gathered, grad.contiguous(), group=ctx.group)
        return gathered @ weight.t(), x.t() @ gathered, None


# --- the ranks ------------------------------------------------------------------------------------------------


def worker(rank, world_size, port, args, results) -> None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    for label, (seconds, waited) in {**fsdp_runs(rank, args), **tp_runs(rank, world_size, args)}.items():
        results.put((label, rank, seconds, waited))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world_size: int, args) -> dict[str, tuple[float, float]]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(worker, args=(world_size, store.port, args, results), nprocs=world_size, join=True,
                       start_method="spawn")
    measured = [results.get() for _ in range(7 * world_size)]
    labels = list(dict.fromkeys(m[0] for m in measured))
    return {label: (max(m[2] for m in measured if m[0] == label), max(m[3] for m in measured if m[0] == label))
            for label in labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gradings", type=int, default=3, help="warm gradings after the first (0: skip part 1)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--units", type=int, default=8, help="51: Linear units")
    parser.add_argument("--width", type=int, default=1024, help="51: their width")
    parser.add_argument("--batch", type=int, default=256, help="51: samples per rank")
    parser.add_argument("--rows", type=int, default=2048, help="53: rows of the gathered input")
    parser.add_argument("--features", type=int, default=1024, help="53: its features")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    if args.gradings:
        gradings(args.gradings)
    print(f"gloo, {args.threads} thread(s) per process on {CORES} CPU core(s); median of {args.reps} steps after "
          f"{WARMUP} warm-up, the slowest rank's. 51: {args.units} x Linear({args.width}, {args.width}), batch "
          f"{args.batch} a rank, float32. 53: the gathered input {args.rows} x {args.features}, each rank's weight "
          f"1/W of {args.features} x {args.features}, float32, forward and backward.\n")
    print(f"{'':52}{'ranks':>6}{'step':>11}{'waiting':>11}")
    for world_size in args.world_sizes:
        for label, (seconds, waited) in run_world(world_size, args).items():
            print(f"{label:52}{world_size:>6}{seconds * 1e3:>9.1f}ms{waited * 1e3:>9.1f}ms")
        print()


if __name__ == "__main__":
    main()
