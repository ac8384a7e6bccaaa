"""How fast are the reference solutions of exercises 07 and 08 next to torch's own?

One run on gloo, world size 2, on this machine's CPU:
  - ring_all_reduce (solutions/07_ring_allreduce.py) against dist.all_reduce on a
    4 MB float32 tensor;
  - one training step (forward, backward, finish_gradient_synchronization) of
    BucketedDDP (solutions/08_bucketed.py) against torch's DistributedDataParallel
    on a stack of Linear layers of about 10 M parameters, both with 25 MB buckets.
Each figure is the median of several repetitions after a warm-up, ours and
torch's alternated so that both see the same load.
Targets: the ring within 2x of dist.all_reduce, the bucketed step within 1.3x of DDP.

    python benchmarks/bench_under_the_hood.py [--reps 15]

Not a test: timings depend on the machine.
"""

import argparse
import importlib.util
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
TENSOR_ELEMENTS = 2**20  # float32: 4 MiB
LAYERS, WIDTH, BATCH = 10, 1000, 32  # 10 x (1000 x 1000 + 1000) = 10.01 M parameters
BUCKET_CAP_MB = 25.0
WARMUP = 3
THREADS = max(1, (os.cpu_count() or 2) // WORLD_SIZE)  # compute threads per rank


def load(relative_path: str):
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed_pair(ours, theirs, reps: int) -> tuple[float, float]:
    """Median seconds of ours() and theirs(), alternated so both see the same machine load."""
    for _ in range(WARMUP):
        ours()
        theirs()
    times = {ours: [], theirs: []}
    for _ in range(reps):
        for fn in (ours, theirs):
            dist.barrier()  # every rank starts together
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    return statistics.median(times[ours]), statistics.median(times[theirs])


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def worker(rank: int, port: int, reps: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(THREADS)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    ring_all_reduce = load("solutions/07_ring_allreduce.py").ring_all_reduce
    BucketedDDP = load("solutions/08_bucketed.py").BucketedDDP

    # 1. The all-reduce alone.
    tensor = torch.randn(TENSOR_ELEMENTS)
    ring_s, torch_s = timed_pair(lambda: ring_all_reduce(tensor), lambda: dist.all_reduce(tensor), reps)

    # 2. One training step.
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    ddp = DistributedDataParallel(make_model(), bucket_cap_mb=BUCKET_CAP_MB)
    bucketed = BucketedDDP(make_model(), BUCKET_CAP_MB)

    def ddp_step():
        ddp(x).square().mean().backward()

    def bucketed_step():
        bucketed(x).square().mean().backward()
        bucketed.finish_gradient_synchronization()

    bucketed_s, ddp_s = timed_pair(bucketed_step, ddp_step, reps)
    if rank == 0:
        params = sum(p.numel() for p in bucketed.parameters())
        results.put((ring_s, torch_s, ddp_s, bucketed_s, params))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions of each (after a warm-up)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(worker, args=(free_port(), args.reps, results), nprocs=WORLD_SIZE, join=True,
                       start_method="spawn")
    ring_s, torch_s, ddp_s, bucketed_s, params = results.get()
    mb = TENSOR_ELEMENTS * 4 / 2**20
    print(f"gloo, world size {WORLD_SIZE}, {THREADS} thread(s) per rank, "
          f"median of {args.reps} after {WARMUP} warm-up runs\n")
    print(f"{'':44}{'ours':>10}{'torch':>10}{'ratio':>8}{'target':>8}")
    print(f"{f'all-reduce, {mb:g} MiB float32':44}{ring_s * 1e3:>8.2f}ms{torch_s * 1e3:>8.2f}ms"
          f"{ring_s / torch_s:>8.2f}{'< 2':>8}")
    print(f"{f'train step, {params / 1e6:.2f} M parameters, {BUCKET_CAP_MB:g} MB buckets':44}"
          f"{bucketed_s * 1e3:>8.2f}ms{ddp_s * 1e3:>8.2f}ms{bucketed_s / ddp_s:>8.2f}{'< 1.3':>8}")


if __name__ == "__main__":
    main()
