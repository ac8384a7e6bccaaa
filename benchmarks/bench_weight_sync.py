"""Exercise 37's weight sync beside the same copies in one process, and beside the broadcast RL stacks use.

Two parts, one run on this machine's CPU (gloo):
  1. the grading: warm gradings of solutions/37_weight_sync.py (a warm process pool, as `ddp-grade watch`
     and the grading server keep one), beside the same work without parallelism: every slice of every graded
     push cut from the whole weights in one process;
  2. at a size where bytes show (the grader's model with --dim, --hidden and --blocks, float32, the usual
     layout: column-parallel up projections and head, row-parallel down projections): the whole model cut
     into every inference rank's slices in one process; push_weights (solutions/37_weight_sync.py) on
     trainer + inference ranks; and the sync of verl's and OpenRLHF's shape, each parameter gathered whole
     on the trainer ranks (DTensor.full_tensor()) and broadcast from the first one to the inference ranks,
     each narrowing out its slice. For each: the median sync (the slowest rank's), the bytes each inference
     rank receives, and the most a trainer rank holds of a parameter at once beyond its own rows.
Every process computes with one thread (--threads).

    python benchmarks/bench_weight_sync.py [--gradings 3] [--dim 512] [--hidden 2048] [--blocks 2]
                                           [--splits 2+2 1+2 2+1]

Not a test: timings depend on the machine. On a 2-core CPU the ranks share cores and gloo's messages go
through the kernel; what the second part shows is the traffic (the broadcast delivers I times a split
parameter's bytes, the slices exactly what the layout holds) and the memory (the broadcast holds each
parameter whole on every trainer rank in turn, the slices never).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WARMUP = 1
CORES = os.cpu_count() or 2


def load(relative_path: str):
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- 1. the grading ----------------------------------------------------------------------------------


def graded_work_in_one_process(world_sizes) -> float:
    """Seconds one process takes to cut every inference rank's slices of every graded push from the whole
    weights (what the ranks move between them)."""
    from grader.rank.drivers import ex37_weight_sync as ex_rank
    from grader.checks.ex37_weight_sync import reference

    start = time.perf_counter()
    for world_size in world_sizes:
        for split_index, split in enumerate(ex_rank.splits(world_size)):
            for scenario in ex_rank.SCENARIOS:
                full = ex_rank.weights(scenario, split_index, len(split["inference"]))
                for j in range(len(split["inference"])):
                    for name, tensor in full.items():
                        dim = reference.split_dim(name, ex_rank.LAYOUTS[scenario])
                        reference.kept_slice(tensor, reference.kept_ranges(list(tensor.shape), dim,
                                                                           len(split["inference"]), j)).clone()
    return time.perf_counter() - start


def gradings(count: int) -> None:
    from grader import catalog

    world_sizes = catalog.by_id("37").world_sizes
    first, later = warm.gradings(ROOT / "solutions" / "37_weight_sync.py", count)
    alone = statistics.median(graded_work_in_one_process(world_sizes) for _ in range(3))
    print(f"warm gradings of solutions/37_weight_sync.py (world sizes {', '.join(map(str, world_sizes))}, one "
          f"after the other): first {first:.2f} s, later (median of {count}) {later:.2f} s")
    print(f"the same slices, every graded push, cut in one process: {alone * 1e3:.1f} ms\n")


# --- 2. at a size where bytes show --------------------------------------------------------------------


def build(args, device="cpu"):
    from grader.rank.drivers.ex37_weight_sync import Model

    torch.manual_seed(0)
    return Model(args.dim, args.dim, args.hidden, args.dim, n_blocks=args.blocks).to(device)


def usual_layout(blocks: int) -> dict:
    """Column-parallel up projections and head, row-parallel down projections (the grader's layout a)."""
    layout = {"out": "colwise"}
    for b in range(blocks):
        layout.update({f"blocks.{b}.up": "colwise", f"blocks.{b}.down": "rowwise"})
    return layout


def broadcast_sync(model, layout, trainers, inference, group) -> tuple[dict | None, int]:
    """verl's and OpenRLHF's shape: each parameter whole on every trainer rank, broadcast from the first to the
    inference ranks, each narrowing out its slice. Returns (slices or None, the largest whole parameter this
    rank held beyond its rows, in bytes)."""
    solution = load("solutions/37_weight_sync.py")
    me = dist.get_rank()
    out, held = ({} if me in inference else None), 0
    for name, p in model.named_parameters():
        if me in trainers:
            whole = p.full_tensor()  # an all-gather among the trainer ranks
            held = max(held, whole.numel() * whole.element_size())
        else:
            whole = torch.empty(p.shape, dtype=p.dtype)
        if me == trainers[0] or me in inference:
            dist.broadcast(whole, src=trainers[0], group=group)
        if me in inference:
            dim = solution.split_dim(name, layout)
            if dim is None:
                out[name] = whole
            else:
                size = p.shape[dim] // len(inference)
                out[name] = whole.narrow(dim, inference.index(me) * size, size).clone()
    return out, held


class Received:
    """Bytes this rank receives through dist.recv / irecv / broadcast (as a receiver), counted at the call."""

    def __enter__(self):
        self.irecv, self.recv, self.broadcast, self.bytes = dist.irecv, dist.recv, dist.broadcast, 0

        def count(original, receiving):
            def call(tensor, *args, **kwargs):
                if receiving(args, kwargs):
                    self.bytes += tensor.numel() * tensor.element_size()
                return original(tensor, *args, **kwargs)
            return call

        always = lambda args, kwargs: True  # noqa: E731
        not_source = lambda args, kwargs: kwargs.get("src", args[0] if args else None) != dist.get_rank()  # noqa: E731
        dist.irecv = dist.distributed_c10d.irecv = count(self.irecv, always)
        dist.recv = count(self.recv, always)
        dist.broadcast = count(self.broadcast, not_source)
        return self

    def __exit__(self, *exc):
        dist.irecv = dist.distributed_c10d.irecv = self.irecv
        dist.recv, dist.broadcast = self.recv, self.broadcast


def worker(rank, world_size, port, args, trainers, inference, results) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    solution = load("solutions/37_weight_sync.py")
    layout = usual_layout(args.blocks)
    mesh = DeviceMesh("cpu", trainers)
    group = dist.new_group([trainers[0]] + inference)
    if rank in trainers:
        model = build(args)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        with torch.device("meta"):
            model = build(args, "meta")
    runs = {"push_weights (slices)": lambda: (solution.push_weights(model, layout, trainers, inference), 0),
            "gather + broadcast": lambda: broadcast_sync(model, layout, trainers, inference, group)}
    for label, sync in runs.items():
        seconds = []
        for i in range(WARMUP + args.reps):
            dist.barrier()
            start = time.perf_counter()
            with Received() as received:
                _, held = sync()
            if i >= WARMUP:
                seconds.append(time.perf_counter() - start)
        results.put((label, rank, statistics.median(seconds), received.bytes, held))
    dist.barrier()
    dist.destroy_process_group()


def run_split(trainer_count: int, inference_count: int, args) -> list[tuple]:
    world_size = trainer_count + inference_count
    trainers, inference = list(range(trainer_count)), list(range(trainer_count, world_size))
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.start_processes(worker, args=(world_size, store.port, args, trainers, inference, results), nprocs=world_size,
                       join=True, start_method="spawn")
    return [results.get() for _ in range(2 * world_size)], trainers, inference


def one_process(args, inference_count: int) -> float:
    """Median seconds to cut every inference rank's slices from the whole model in one process."""
    solution = load("solutions/37_weight_sync.py")
    layout = usual_layout(args.blocks)
    model = build(args)
    times = []
    for _ in range(WARMUP + args.reps):
        start = time.perf_counter()
        for name, p in model.named_parameters():
            dim = solution.split_dim(name, layout)
            for j in range(inference_count):
                (rows, cols) = solution.kept_part(list(p.shape), dim, inference_count, j)
                piece = p.detach()[rows[0]:rows[1]]
                (piece[:, cols[0]:cols[1]] if cols else piece).clone()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:])


def scaling(args) -> None:
    torch.set_num_threads(args.threads)
    model = build(args)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    print(f"the grader's model with dim {args.dim}, hidden {args.hidden}, {args.blocks} blocks: "
          f"{total / 2**20:.1f} MiB in float32, its largest parameter {largest / 2**20:.2f} MiB; gloo, "
          f"{args.threads} thread(s) per process on {CORES} CPU core(s); median of {args.reps} syncs after {WARMUP} "
          "warm-up\n")
    print(f"{'':50}{'sync':>10}{'received/inference rank':>26}{'whole held/trainer':>20}")
    for split in args.splits:
        trainer_count, inference_count = (int(n) for n in split.split("+"))
        alone = one_process(args, inference_count)
        print(f"{f'1 process, cut into {inference_count} slices':50}{alone * 1e3:>8.1f}ms{'-':>26}{'-':>20}")
        measured, trainers, inference = run_split(trainer_count, inference_count, args)
        for label in ("push_weights (slices)", "gather + broadcast"):
            mine = [m for m in measured if m[0] == label]
            got = max(m[3] for m in mine if m[1] in inference) / 2**20
            held = max(m[4] for m in mine if m[1] in trainers) / 2**20
            print(f"{f'{label}, {trainer_count} trainer + {inference_count} inference':50}"
                  f"{max(m[2] for m in mine) * 1e3:>8.1f}ms{got:>23.2f}MiB{held:>17.2f}MiB")
    print("\nA trainer rank that is the only one holds every parameter whole anyway; with 2 or more, the broadcast "
          "holds each parameter whole on every trainer rank in turn (up to the largest), and delivers each split "
          "parameter whole to every inference rank.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gradings", type=int, default=3, help="warm gradings after the first (0: skip part 1)")
    parser.add_argument("--dim", type=int, default=512, help="the model's width (even)")
    parser.add_argument("--hidden", type=int, default=2048, help="the up projections' outputs (divisible by I)")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--splits", nargs="+", default=["2+2", "1+2", "2+1"], help="trainer+inference ranks")
    parser.add_argument("--reps", type=int, default=3, help="timed syncs (after a warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads in each process")
    args = parser.parse_args()
    for split in args.splits:
        inference = int(split.split("+")[1])
        if args.hidden % inference or args.dim % inference:
            parser.error(f"--hidden {args.hidden} and --dim {args.dim} must be divisible by {inference}")
    print(f"{CORES} cores, load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}\n")
    if args.gradings:
        gradings(args.gradings)
    scaling(args)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
