"""Exercise 52's ZB-H1 step beside 13's 1F1B on the same stages, and beside torch.distributed.pipelining's
ScheduleInterleavedZeroBubble (one stage per rank) and Schedule1F1B; then warm gradings of 52 beside 13's.

1. The step: bench_pipeline's model (a stack of Linear + GELU, cut into one stage per rank), one forward and
   backward of a batch in micro-batches on gloo (no optimizer), the median of several steps after a warm-up, with
   the peak bytes of activations saved for backward on the busiest rank and on the last one (saved-tensor hooks;
   parameters not counted). Each rank gets cpu_count / W threads. On a CPU the idle slots are real (a rank waits
   on its receive), but B and W share the rank's cores with nothing else: what ZB-H1 saves is the bubble, and
   what it costs here is W's second pass through the stage's layers (the solution's W asks autograd again from
   the stage's output; torch's keeps B's intermediate gradients instead).
2. The grading: warm gradings of solutions/52_zero_bubble.py and solutions/13_pipeline.py, each in a warm
   session (the first grading, then the median of the later ones).

    python benchmarks/bench_zero_bubble.py [--world-size 2] [--microbatches 8] [--reps 10] [--gradings 3]

Not a test: timings depend on the machine and its load.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import bench_pipeline as base
import warm

ROOT = base.ROOT


def worker(rank: int, world_size: int, port: int, microbatches: int, reps: int, threads: int, results) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    zero_bubble_step = base.load("solutions/52_zero_bubble.py").zero_bubble_step
    pipeline_step = base.load("solutions/13_pipeline.py").pipeline_step
    x, y = base.make_batch()
    batch = x if rank == 0 else None
    target = y if rank == world_size - 1 else None
    loss_fn = nn.functional.mse_loss
    figures = {}

    for name, step in (("1F1B (13's solution)",
                        lambda stage: pipeline_step(stage, batch, target, microbatches, loss_fn, schedule="1f1b")),
                       ("ZB-H1 (52's solution)",
                        lambda stage: zero_bubble_step(stage, batch, target, microbatches, loss_fn))):
        stage = base.Measured(base.make_stages(world_size)[rank])

        def ours(stage=stage, step=step):
            stage.zero_grad(set_to_none=True)
            step(stage)

        seconds = base.median_step(ours, reps, group=True)
        figures[name] = (seconds, stage.peak_bytes)

    for name, make in (("Schedule1F1B (torch)", lambda s: Schedule1F1B(s, microbatches, loss_fn=loss_fn)),
                       ("ScheduleInterleavedZeroBubble (torch)",
                        lambda s: ScheduleInterleavedZeroBubble([s], microbatches, loss_fn=loss_fn))):
        stage = base.Measured(base.make_stages(world_size)[rank])
        schedule = make(PipelineStage(stage, rank, world_size, torch.device("cpu")))

        def theirs(stage=stage, schedule=schedule):
            stage.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            elif rank == world_size - 1:
                schedule.step(target=y)
            else:
                schedule.step()

        base.median_step(theirs, 1, group=True)  # the first steps also infer shapes: start counting after
        stage.peak_bytes = 0
        seconds = base.median_step(theirs, reps, group=True)
        figures[name] = (seconds, stage.peak_bytes)

    results.put((rank, figures))
    dist.barrier()
    dist.destroy_process_group()


def steps(world_size: int, microbatches: int, reps: int) -> None:
    threads = max(1, (os.cpu_count() or 2) // world_size)
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(world_size, store.port, microbatches, reps, threads, results),
                       nprocs=world_size, join=True, start_method="spawn")
    per_rank = dict(results.get() for _ in range(world_size))
    w, m = world_size, microbatches
    params = sum(p.numel() for stage in base.make_stages(w) for p in stage.parameters())
    print(f"gloo, {w} ranks x {threads} thread(s); median of {reps} steps after {base.WARMUP} warm-up steps")
    print(f"model: {w * base.LAYERS_PER_STAGE} x Linear({base.WIDTH}, {base.WIDTH}) + GELU ({params / 1e6:.1f} M "
          f"parameters), {base.LAYERS_PER_STAGE} per stage; batch {base.BATCH} in {m} micro-batches; in unit time "
          f"(F = B = W) 1F1B idles 3 (W - 1) = {3 * (w - 1)} slots per rank, ZB-H1 W - 1 = {w - 1}, of "
          f"{3 * m + 3 * (w - 1)} and {3 * m + w - 1}\n")
    print(f"{'':40}{'time/step':>12}{'vs 1F1B':>10}{'peak saved, busiest rank':>27}{'last rank':>12}")
    baseline = max(per_rank[r]["1F1B (13's solution)"][0] for r in per_rank)
    for name in per_rank[0]:
        seconds = max(per_rank[r][name][0] for r in per_rank)  # the step ends when the slowest rank ends
        peak = max(per_rank[r][name][1] for r in per_rank)
        last = per_rank[w - 1][name][1]
        print(f"{name:40}{seconds * 1e3:>10.1f}ms{seconds / baseline:>9.2f}x{peak / 2**20:>21.2f} MiB"
              f"{last / 2**20:>8.2f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="pipeline stages, one rank each")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (at least the world size)")
    parser.add_argument("--reps", type=int, default=10, help="timed steps of each (after a warm-up)")
    parser.add_argument("--gradings", type=int, default=3, help="warm gradings after the first (0: skip part 2)")
    args = parser.parse_args()
    if args.microbatches < args.world_size or base.BATCH % args.microbatches:
        parser.error(f"--microbatches must be at least --world-size and divide the batch of {base.BATCH}")
    steps(args.world_size, args.microbatches, args.reps)
    if args.gradings:
        print()
        for name in ("52_zero_bubble.py", "13_pipeline.py"):
            first, later = warm.gradings(ROOT / "solutions" / name, args.gradings)
            print(f"warm gradings of solutions/{name} (world sizes 2, 3, 4): first {first:.2f} s, then a median of "
                  f"{later:.2f} s over {args.gradings}")


if __name__ == "__main__":
    main()
