"""The tensor-parallel MLP of exercise 12 beside the dense MLP and beside torch's own tensor parallelism.

One run on this machine's CPU, gloo, float32: a transformer MLP (d -> 4d, GELU, 4d -> d) on
a batch of tokens, forward and backward. Side by side:
  - dense: the plain MLP in one process;
  - ParallelMLP (solutions/12_tensor_parallel.py) on W ranks;
  - torch's ColwiseParallel / RowwiseParallel (parallelize_module on a DeviceMesh) on W ranks.
For each: the median time of a forward and backward, the parameter bytes each rank holds,
and what each rank all-reduces per step (payload bytes and number of collectives, counted
by wrapping the all-reduce functions each one calls). Every process computes with one
thread by default (--threads), so that W ranks use W cores where dense uses one; on a busy
machine several threads per process mostly wait for each other.

    python benchmarks/bench_tensor_parallel.py [--reps 10] [--world-sizes 2 4] [--d 512] [--threads 1]

Not a test: timings depend on the machine. On one CPU the ranks share the same cores and
memory bandwidth, so tensor parallelism cannot be faster than dense here; what it shows is
the memory per rank (1/W) and the traffic it pays for it, which does not shrink with W.
"""

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
BATCH, SEQ = 4, 64
WARMUP = 2
CORES = os.cpu_count() or 2


def load(relative_path: str):
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def build(d: int) -> MLP:
    torch.manual_seed(0)
    return MLP(d)


def step(module, x: torch.Tensor) -> None:
    """One forward and backward. The input needs a gradient, as the output of the layer before would."""
    module(x.detach().requires_grad_(True)).square().mean().backward()


def step_times(modules: list, x: torch.Tensor, reps: int, sync) -> list[float]:
    """Median seconds of a forward and backward of each module, alternated so that all see the same load
    (sync() lines the ranks up before each)."""
    times = [[] for _ in modules]
    for i in range(WARMUP + reps):
        for module, seconds in zip(modules, times):
            sync()
            start = time.perf_counter()
            step(module, x)
            if i >= WARMUP:
                seconds.append(time.perf_counter() - start)
    return [statistics.median(seconds) for seconds in times]


def held_bytes(module: nn.Module) -> int:
    storages = {}
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


class AllReduceCounter:
    """Counts the all-reduces made through torch.distributed and the functional collectives (torch's TP)."""

    def __init__(self):
        import torch.distributed._functional_collectives as funcol

        self.modules = [(dist, "all_reduce"), (dist.distributed_c10d, "all_reduce"), (funcol, "all_reduce")]
        self.calls, self.bytes = 0, 0

    def __enter__(self):
        self.originals = [getattr(owner, name) for owner, name in self.modules]
        for (owner, name), original in zip(self.modules, self.originals):
            setattr(owner, name, self._wrap(original))
        return self

    def _wrap(self, original):
        def counted(tensor, *args, **kwargs):
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for (owner, name), original in zip(self.modules, self.originals):
            setattr(owner, name, original)


def one_step_traffic(module, x: torch.Tensor) -> tuple[int, int]:
    with AllReduceCounter() as counter:
        step(module, x)
    return counter.calls, counter.bytes


def worker(rank: int, world_size: int, port: int, d: int, reps: int, threads: int, results) -> None:
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    ParallelMLP = load("solutions/12_tensor_parallel.py").ParallelMLP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    x = torch.randn(BATCH, SEQ, d, generator=torch.Generator().manual_seed(1))
    dense = build(d)
    ours = ParallelMLP(dense.fc1, dense.fc2)
    theirs = parallelize_module(build(d), init_device_mesh("cpu", (world_size,)),
                                {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    modules = {"ParallelMLP": ours, "torch TP": theirs}
    traffic = {label: one_step_traffic(module, x) for label, module in modules.items()}
    seconds = step_times(list(modules.values()), x, reps, dist.barrier)
    row = {label: (s, held_bytes(module), *traffic[label]) for (label, module), s in zip(modules.items(), seconds)}
    if rank == 0:
        results.put(row)
    dist.barrier()
    dist.destroy_process_group()


def run_world(world_size: int, d: int, reps: int, threads: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(worker, args=(world_size, store.port, d, reps, threads, results), nprocs=world_size, join=True,
                       start_method="spawn")
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="timed forward+backward steps (after a warm-up)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--d", type=int, default=512, help="model width d (the hidden layer is 4d)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads in each process")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dense = build(args.d)
    x = torch.randn(BATCH, SEQ, args.d, generator=torch.Generator().manual_seed(1))
    [dense_s] = step_times([dense], x, args.reps, lambda: None)
    rows = [("dense, 1 process", 1, (dense_s, held_bytes(dense), 0, 0))]
    for world_size in args.world_sizes:
        measured = run_world(world_size, args.d, args.reps, args.threads)
        rows += [(f"{label}, {world_size} ranks", world_size, values) for label, values in measured.items()]

    activation = BATCH * SEQ * args.d * 4
    print(f"MLP {args.d} -> {4 * args.d} -> {args.d}, {BATCH} x {SEQ} tokens, float32, gloo, {args.threads} "
          f"thread(s) per process on {CORES} CPU core(s); median of {args.reps} forward+backward steps after "
          f"{WARMUP} warm-up\n")
    print(f"{'':24}{'step':>10}{'params/rank':>14}{'all-reduces':>13}{'all-reduced/rank':>18}{'ring wire/rank':>16}")
    for label, world_size, (seconds, held, calls, sent) in rows:
        wire = sent * 2 * (world_size - 1) / world_size
        print(f"{label:24}{seconds * 1e3:>8.1f}ms{held / 2**20:>11.2f}MiB{calls:>13}{sent / 2**20:>15.2f}MiB"
              f"{wire / 2**20:>13.2f}MiB")
    print(f"\nThe activation (batch x sequence x d) is {activation / 2**20:.2f} MiB: one all-reduce of it in forward "
          "and one in backward, whatever the number of ranks.")


if __name__ == "__main__":
    main()
