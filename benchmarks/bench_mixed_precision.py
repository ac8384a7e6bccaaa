"""What does a mixed-precision step cost next to a float32 one?

One run, world size 2, on gloo (CPU) or, with --backend nccl and two GPUs, on NCCL: a DDP step of
train_step_amp (solutions/14_mixed_precision.py: autocast forward, scaled backward, unscale,
clip, scaler.step, update) in bfloat16 and in float16, against torch's plain float32 step with
the same clipping (forward, backward, clip_grad_norm_, optimizer.step, zero_grad), on a stack of
Linear layers. Each figure is the median of several repetitions after a warm-up, alternated with
the float32 step so that both see the same load.

On a CPU, 16-bit autocast is mostly a cost: the casts are extra work and the CPU's matrix
products are not faster in 16 bits unless it has AMX or AVX512-BF16 units. On GPUs with tensor
cores the 16-bit step is the faster one. The figure to read is the ratio.

    python benchmarks/bench_mixed_precision.py [--reps 10] [--backend nccl]

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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
LAYERS, WIDTH, BATCH, CLASSES = 4, 1024, 64, 10
MAX_NORM = 1.0
WARMUP = 3
THREADS = max(1, (os.cpu_count() or 2) // WORLD_SIZE)


def load(relative_path: str):
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, CLASSES))


def timed(fn, reps: int, sync) -> list[float]:
    out = []
    for _ in range(reps):
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return out


def worker(rank: int, port: int, reps: int, backend: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(THREADS)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        sync = torch.cuda.synchronize
    else:
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731
    dist.init_process_group(backend, rank=rank, world_size=WORLD_SIZE)
    train_step_amp = load("solutions/14_mixed_precision.py").train_step_amp
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=g).to(device)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g).to(device)

    ddp = DistributedDataParallel(make_model().to(device), device_ids=[rank] if backend == "nccl" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def fp32_step():
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()

    figures = {}
    for name in ("bfloat16", "float16"):
        scaler = torch.amp.GradScaler(device.type)
        dtype = getattr(torch, name)

        def amp_step():
            train_step_amp(ddp, optimizer, scaler, (x, y), MAX_NORM, dtype)

        for _ in range(WARMUP):
            amp_step()
            fp32_step()
        amp, plain = [], []
        for _ in range(reps):  # alternated: both see the same load
            amp += timed(amp_step, 1, sync)
            plain += timed(fp32_step, 1, sync)
        figures[name] = (statistics.median(amp), statistics.median(plain))
    if rank == 0:
        results.put((figures, sum(p.numel() for p in ddp.parameters())))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions of each (after a warm-up)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(worker, args=(free_port(), args.reps, args.backend, results), nprocs=WORLD_SIZE, join=True,
                       start_method="spawn")
    figures, params = results.get()
    print(f"{args.backend}, world size {WORLD_SIZE}, {THREADS} thread(s) per rank, {params / 1e6:.2f} M parameters, "
          f"batch {BATCH} per rank, median of {args.reps} after {WARMUP} warm-up steps\n")
    print(f"{'one DDP training step':32}{'autocast':>11}{'float32':>11}{'ratio':>8}")
    for name, (amp_s, plain_s) in figures.items():
        print(f"{'train_step_amp, ' + name:32}{amp_s * 1e3:>9.2f}ms{plain_s * 1e3:>9.2f}ms{amp_s / plain_s:>8.2f}")


if __name__ == "__main__":
    main()
