"""The reference pipeline of exercise 13 next to one process running the whole model, and next to
torch.distributed.pipelining's own ScheduleGPipe and Schedule1F1B.

One run on gloo, on this machine's CPU: a stack of Linear layers cut into one stage per rank, one
training step (forward and backward of a batch cut into micro-batches, no optimizer) timed as the
median of several steps after a warm-up, and the peak bytes of activations saved for backward on
the busiest rank (measured with torch.autograd.graph.saved_tensors_hooks around each stage;
parameters that autograd saves are not counted). The single process gets the threads of one rank:
it stands for the whole model on one device.

    python benchmarks/bench_pipeline.py [--world-size 2] [--microbatches 8] [--reps 10]

Not a test: timings depend on the machine.
"""

import argparse
import importlib.util
import os
import statistics
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
LAYERS_PER_STAGE, WIDTH, BATCH = 2, 1024, 64
WARMUP = 3


def load(relative_path: str):
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_stages(world_size: int) -> list[nn.Module]:
    torch.manual_seed(0)
    stages = []
    for _ in range(world_size):
        layers = []
        for _ in range(LAYERS_PER_STAGE):
            layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
        stages.append(nn.Sequential(*layers))
    return stages


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


class Measured(nn.Module):
    """A stage whose activations saved for backward are counted in bytes while they are alive."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        self.live_bytes = 0
        self.peak_bytes = 0

    def forward(self, x):
        params = {p.untyped_storage().data_ptr() for p in self.body.parameters()}

        def pack(t):
            holder = [t]
            if t.untyped_storage().data_ptr() in params:
                return holder
            nbytes = t.numel() * t.element_size()
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            box = _Box(t)
            weakref.finalize(box, self._release, nbytes)
            return box

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            return self.body(x)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


class _Box:
    def __init__(self, t):
        self.t = t


def _unpack(saved):
    return saved.t if isinstance(saved, _Box) else saved[0]


def median_step(step, reps: int, group: bool) -> float:
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(reps):
        if group:
            dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def single_process(world_size: int, reps: int, threads: int) -> tuple[float, int]:
    torch.set_num_threads(threads)
    model = Measured(nn.Sequential(*make_stages(world_size)))
    x, y = make_batch()

    def step():
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()

    seconds = median_step(step, reps, group=False)
    return seconds, model.peak_bytes


def worker(rank: int, world_size: int, port: int, microbatches: int, reps: int, threads: int, results) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    pipeline_step = load("solutions/13_pipeline.py").pipeline_step
    x, y = make_batch()
    batch = x if rank == 0 else None
    target = y if rank == world_size - 1 else None
    figures = {}

    for schedule in ("gpipe", "1f1b"):
        stage = Measured(make_stages(world_size)[rank])

        def ours():
            stage.zero_grad(set_to_none=True)
            pipeline_step(stage, batch, target, microbatches, nn.functional.mse_loss, schedule=schedule)

        seconds = median_step(ours, reps, group=True)
        figures[f"{schedule} (ours)"] = (seconds, stage.peak_bytes)

    for name, schedule_class in (("ScheduleGPipe (torch)", ScheduleGPipe), ("Schedule1F1B (torch)", Schedule1F1B)):
        stage = Measured(make_stages(world_size)[rank])
        torch_schedule = schedule_class(PipelineStage(stage, rank, world_size, torch.device("cpu")), microbatches,
                                        loss_fn=nn.functional.mse_loss)

        def theirs():
            stage.zero_grad(set_to_none=True)
            if rank == 0:
                torch_schedule.step(x)
            elif rank == world_size - 1:
                torch_schedule.step(target=y)
            else:
                torch_schedule.step()

        seconds = median_step(theirs, 1, group=True)  # the first steps also infer shapes: start counting after
        stage.peak_bytes = 0
        seconds = median_step(theirs, reps, group=True)
        figures[name] = (seconds, stage.peak_bytes)

    results.put((rank, figures))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="pipeline stages, one rank each")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (at least the world size)")
    parser.add_argument("--reps", type=int, default=10, help="timed steps of each (after a warm-up)")
    args = parser.parse_args()
    if args.microbatches < args.world_size or BATCH % args.microbatches:
        parser.error(f"--microbatches must be at least --world-size and divide the batch of {BATCH}")
    threads = max(1, (os.cpu_count() or 2) // args.world_size)

    single_s, single_bytes = single_process(args.world_size, args.reps, threads)

    store = dist.TCPStore("127.0.0.1", 0, args.world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args.world_size, store.port, args.microbatches, args.reps, threads, results),
                       nprocs=args.world_size, join=True, start_method="spawn")
    per_rank = dict(results.get() for _ in range(args.world_size))

    w, m = args.world_size, args.microbatches
    params = sum(p.numel() for stage in make_stages(w) for p in stage.parameters())
    print(f"gloo, {w} ranks x {threads} thread(s); the single process has {threads} thread(s) too; median of "
          f"{args.reps} steps after {WARMUP} warm-up steps")
    print(f"model: {w * LAYERS_PER_STAGE} x Linear({WIDTH}, {WIDTH}) + GELU ({params / 1e6:.1f} M parameters), "
          f"{LAYERS_PER_STAGE} per stage; batch {BATCH} in {m} micro-batches; "
          f"textbook bubble (W - 1) / (M + W - 1) = {(w - 1) / (m + w - 1):.0%}\n")
    print(f"{'':34}{'time/step':>12}{'vs single':>11}{'peak saved activations':>26}")
    print(f"{'single process, whole batch':34}{single_s * 1e3:>10.1f}ms{1.0:>10.2f}x"
          f"{single_bytes / 2**20:>18.2f} MiB")
    for name in per_rank[0]:
        seconds = max(per_rank[r][name][0] for r in range(w))
        peak = max(per_rank[r][name][1] for r in range(w))
        busiest = max(range(w), key=lambda r: per_rank[r][name][1])
        print(f"{'pipeline, ' + name:34}{seconds * 1e3:>10.1f}ms{single_s / seconds:>10.2f}x"
              f"{peak / 2**20:>18.2f} MiB (rank {busiest})")


if __name__ == "__main__":
    main()
