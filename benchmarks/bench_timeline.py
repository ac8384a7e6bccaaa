"""What recording a timeline costs a grading: exercise 13's reference pipeline step (a stack of Linear
layers cut into one stage per rank, gloo on this machine's CPU) timed three ways in one run, side by
side: with no recording; with the recording as a grading makes it without a file (each event kept in
memory, as before a stopped run could be drawn); and with the recording writing each event, and each
blocking call as it starts, to the rank's file in the run's folder (what the grader reads after it
stops a run). Each way is timed as the median of several steps after a warm-up, the three ways
interleaved step by step so that the machine's load falls on all of them alike; the events a step
records are counted.

    python benchmarks/bench_timeline.py [--world-size 2] [--microbatches 8] [--steps 30]

Not a test: timings depend on the machine.
"""

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
LAYERS_PER_STAGE, WIDTH, BATCH = 2, 256, 64
WARMUP = 3
WAYS = ("no recording", "recorded in memory", "recorded and flushed")


def load(relative_path: str):
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(rank: int, world_size: int, port: int, microbatches: int, steps: int, folder: str, queue) -> None:
    from grader.rank import rank_timeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=120))
    solution = load("solutions/13_pipeline.py")
    torch.manual_seed(0)
    stage = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS_PER_STAGE)])
    batch = torch.randn(BATCH, WIDTH) if rank == 0 else None
    target = torch.randn(BATCH, WIDTH) if rank == world_size - 1 else None

    def step(schedule: str) -> None:
        stage.zero_grad(set_to_none=True)
        solution.pipeline_step(stage, batch, target, microbatches, nn.functional.mse_loss, schedule=schedule)

    def way(name: str):
        if name == "no recording":
            return contextlib.nullcontext(None)
        path = os.path.join(folder, rank_timeline.flush_name(rank)) if name == "recorded and flushed" else None
        return rank_timeline.recording(path)

    times = {name: [] for name in WAYS}
    events = {}
    for i in range(WARMUP + steps):
        for name in WAYS:  # interleaved: the load of the moment falls on every way alike
            for schedule in ("gpipe", "1f1b"):
                dist.barrier()
                with way(name) as recorder:
                    t0 = time.perf_counter()
                    step(schedule)
                    seconds = time.perf_counter() - t0
                if i >= WARMUP:
                    times[name].append(seconds)
                if recorder is not None:
                    events[name] = len(recorder.events)
    queue.put((rank, {name: (statistics.median(t), min(t)) for name, t in times.items()}, events))
    dist.destroy_process_group()


def per_call(calls: int, blocks: int) -> dict:
    """Microseconds one recorded call costs: a 4-byte all_reduce in a gloo group of one, ``calls`` at a time,
    each way in turn, ``blocks`` times; the least of the blocks (the machine's load only ever adds)."""
    import socket

    from grader.rank import rank_timeline

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    tensor = torch.ones(1)
    best = {name: float("inf") for name in WAYS}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(blocks):
            for name in WAYS:
                path = os.path.join(folder, "rank0.timeline") if name == "recorded and flushed" else None
                with contextlib.nullcontext() if name == "no recording" else rank_timeline.recording(path):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        dist.all_reduce(tensor)
                    best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    dist.destroy_process_group()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--blocks", type=int, default=7)
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=worker, args=(r, args.world_size, port, args.microbatches, args.steps, folder,
                                                  queue)) for r in range(args.world_size)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    print(f"13's reference pipeline step (gpipe and 1f1b), world size {args.world_size}, {args.microbatches} "
          f"micro-batches, {WIDTH}-wide layers; median / least of {args.steps} steps per way, in ms:")
    print(f"{'rank':>6}" + "".join(f"{name:>24}" for name in WAYS) + f"{'flushed / memory':>20}")
    for rank, timed, events in results:
        print(f"{rank:>6}" + "".join(f"{timed[name][0] * 1000:>14.2f} / {timed[name][1] * 1000:<7.2f}" for name in WAYS)
              + f"{timed['recorded and flushed'][0] / timed['recorded in memory'][0]:>11.3f} / "
              + f"{timed['recorded and flushed'][1] / timed['recorded in memory'][1]:<6.3f}")
    print("events recorded per step: " + ", ".join(f"rank {rank} {events.get('recorded and flushed', 0)}"
                                                     for rank, _, events in results))
    best = per_call(args.calls, args.blocks)
    print(f"one 4-byte all_reduce in a group of one, least of {args.blocks} blocks of {args.calls}, in us: "
          + ", ".join(f"{name} {best[name] * 1e6:.1f}" for name in WAYS)
          + f"; the file adds {(best['recorded and flushed'] - best['recorded in memory']) * 1e6:.1f} us a call, "
          f"the recording {(best['recorded and flushed'] - best['no recording']) * 1e6:.1f} us in all")


if __name__ == "__main__":
    main()
