"""Exercise 35's float8 layer and all-gather beside the same work in float32, and the grading's own time.

Three parts, one run on this machine's CPU (gloo):
  1. the grading: warm gradings of solutions/35_float8.py (a warm process pool, as `ddp-grade watch` and the
     grading server keep one), beside the same work without parallelism in one process: the layer's four graded
     calls and the twenty training steps with the solution's Float8Linear, the same with nn.Linear in float32,
     and every graded weight cast whole (no all-gather);
  2. one linear layer at a size where compute shows (--rows x --size by --size, float32 master weights): the
     median forward and backward with nn.Linear and with Float8Linear, the bytes autograd keeps for backward
     (float8 keeps x and the weight in one byte per element), and how far float8's output and weight gradient
     are from float32's (relative to the largest value);
  3. the all-gather of a --size x --size weight sharded over W ranks: float8_all_gather beside all-gathering
     the float32 shards, the median time and the bytes each rank sends.
Every process computes with one thread (--threads).

    python benchmarks/bench_float8.py [--gradings 3] [--size 1024] [--rows 2048] [--world-sizes 2 4]

Not a test: timings depend on the machine. A CPU has no float8 arithmetic: torch 2.13's CPU _scaled_mm
upcasts both operands to float32 and multiplies there, so the float8 layer is slower here than float32 (the
casts cost extra), where an H100 multiplies float8 at twice bfloat16's rate. What carries over is the bytes:
a quarter of float32's kept for backward and sent by the all-gather.
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
from torch import nn

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


def graded_work_in_one_process(Linear, world_sizes) -> float:
    """Seconds one process takes for the layer's graded calls, the twenty steps and every weight's cast."""
    from grader.rank.drivers import ex35_float8 as ex_rank
    from grader.checks.ex35_float8 import reference

    start = time.perf_counter()
    layers = {}
    for call in ex_rank.CALLS:
        name = ex_rank.LAYER_OF[call]
        layer = layers.setdefault(name, Linear(ex_rank.make_linear(name)))
        if call == "outlier":
            ex_rank.plant_weight_outlier(layer.weight)
        x, grad = ex_rank.call_inputs(call)
        (layer(x.requires_grad_(True)) * grad).sum().backward()
    model = ex_rank.make_mlp()
    for index, module in enumerate(model):
        if isinstance(module, nn.Linear):
            model[index] = Linear(module)
    x, target = ex_rank.training_data()
    params, state = list(model.parameters()), []
    for step in range(1, ex_rank.STEPS + 1):
        for p in params:
            p.grad = None
        ex_rank.loss_fn(model(x), target).backward()
        ex_rank.adamw_step(params, state, step)
    for size in world_sizes:
        for scenario in ex_rank.GATHER_SCENARIOS:
            reference.cast(ex_rank.gather_weight(scenario, size), ex_rank.E4M3)
    return time.perf_counter() - start


def gradings(count: int) -> None:
    from grader import catalog, grading
    from grader.rank import harness
    from grader.grading import GradeOptions, grade_file

    solution = load("solutions/35_float8.py")
    world_sizes = catalog.by_id("35").world_sizes
    grading.warm_up()
    walls = []
    with harness.Session(spares=True) as session:
        for _ in range(count + 1):
            start = time.perf_counter()
            report = grade_file(str(ROOT / "solutions" / "35_float8.py"), session, GradeOptions())
            walls.append(time.perf_counter() - start)
            if report.status != "passed":
                sys.exit(f"solutions/35_float8.py did not pass: {report.status}")
    later = statistics.median(walls[1:]) if count else float("nan")
    float8 = statistics.median(graded_work_in_one_process(solution.Float8Linear, world_sizes) for _ in range(3))
    float32 = statistics.median(graded_work_in_one_process(lambda linear: linear, world_sizes) for _ in range(3))
    print(f"warm gradings of solutions/35_float8.py (the layer in one process, the all-gather on "
          f"{', '.join(map(str, world_sizes))} ranks, at once): first {walls[0]:.2f} s, later (median of {count}) "
          f"{later:.2f} s")
    print(f"the same work in one process: with Float8Linear {float8 * 1e3:.1f} ms, with nn.Linear (float32) "
          f"{float32 * 1e3:.1f} ms\n")


# --- 2. one layer ------------------------------------------------------------------------------------


class SavedBytes:
    """The bytes of the distinct storages autograd saves for backward while on (saved_tensors_hooks)."""

    def __enter__(self):
        self.storages = {}

        def pack(t):
            storage = t.untyped_storage()
            self.storages[storage.data_ptr()] = storage.nbytes()
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def one_layer(args) -> None:
    solution = load("solutions/35_float8.py")
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(args.size, args.size)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(args.size, args.size, generator=g) / args.size ** 0.5)
    x = torch.randn(args.rows, args.size, generator=g)
    grad = torch.randn(args.rows, args.size, generator=g) * 1e-3
    results = {}
    for label, layer in (("nn.Linear, float32", linear), ("Float8Linear", solution.Float8Linear(linear))):
        seconds = []
        for i in range(WARMUP + args.reps):
            inp = x.clone().requires_grad_(True)
            linear.weight.grad = None
            start = time.perf_counter()
            with SavedBytes() as saved:
                out = layer(inp)
            (out * grad).sum().backward()
            if i >= WARMUP:
                seconds.append(time.perf_counter() - start)
        results[label] = (statistics.median(seconds), saved.bytes, out.detach(), linear.weight.grad.clone())
    base_out, base_grad = results["nn.Linear, float32"][2:]
    print(f"one layer: x [{args.rows}, {args.size}] through Linear({args.size}, {args.size}), forward and backward, "
          f"median of {args.reps} after {WARMUP} warm-up, {args.threads} thread(s)")
    print(f"{'':22}{'step':>10}{'kept for backward':>20}{'output off':>13}{'weight.grad off':>17}")
    for label, (seconds, saved, out, wgrad) in results.items():
        off = float((out - base_out).abs().max() / base_out.abs().max())
        goff = float((wgrad - base_grad).abs().max() / base_grad.abs().max())
        print(f"{label:22}{seconds * 1e3:>8.1f}ms{saved / 2**20:>17.2f}MiB{off:>13.2%}{goff:>17.2%}")
    print()


# --- 3. the all-gather -------------------------------------------------------------------------------


def worker(rank, world_size, port, args, results) -> None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    solution = load("solutions/35_float8.py")
    weight = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(1)) * 0.02
    rows = args.size // world_size
    shard = weight[rank * rows:(rank + 1) * rows].contiguous()

    def float32_gather():
        out = torch.empty(world_size * rows, args.size)
        dist.all_gather_single(out, shard)
        return out

    runs = {"float8_all_gather": (lambda: solution.float8_all_gather(shard, dist.group.WORLD), shard.numel() + 4),
            "all-gather of the float32 shards": (float32_gather, 4 * shard.numel())}
    for label, (gather, sent) in runs.items():
        seconds = []
        for i in range(WARMUP + args.reps):
            dist.barrier()
            start = time.perf_counter()
            gather()
            if i >= WARMUP:
                seconds.append(time.perf_counter() - start)
        results.put((label, world_size, rank, statistics.median(seconds), sent))
    dist.barrier()
    dist.destroy_process_group()


def all_gathers(args) -> None:
    solution = load("solutions/35_float8.py")
    weight = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(1)) * 0.02
    seconds = []
    for _ in range(WARMUP + args.reps):
        start = time.perf_counter()
        solution.cast(weight, solution.E4M3)
        seconds.append(time.perf_counter() - start)
    print(f"all-gather of a {args.size} x {args.size} weight, gloo, median of {args.reps} after {WARMUP} warm-up")
    print(f"{'':46}{'time':>10}{'sent per rank':>16}")
    print(f"{'1 process, the whole weight cast to E4M3':46}{statistics.median(seconds[WARMUP:]) * 1e3:>8.1f}ms"
          f"{0:>13.2f}MiB")
    ctx = mp.get_context("spawn")
    for world_size in args.world_sizes:
        results = ctx.SimpleQueue()
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        mp.start_processes(worker, args=(world_size, store.port, args, results), nprocs=world_size, join=True,
                           start_method="spawn")
        measured = [results.get() for _ in range(2 * world_size)]
        for label in ("float8_all_gather", "all-gather of the float32 shards"):
            mine = [m for m in measured if m[0] == label]
            print(f"{label + f', {world_size} ranks':46}{max(m[3] for m in mine) * 1e3:>8.1f}ms"
                  f"{mine[0][4] / 2**20:>13.2f}MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gradings", type=int, default=3, help="warm gradings timed after the first")
    parser.add_argument("--size", type=int, default=1024, help="the layer's features in and out; the weight's rows")
    parser.add_argument("--rows", type=int, default=2048, help="rows of the layer's input (batch x sequence)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="compute threads in each process")
    args = parser.parse_args()
    for world_size in args.world_sizes:
        if args.size % world_size:
            parser.error(f"--size {args.size} is not divisible by {world_size}")
    torch.set_num_threads(args.threads)
    print(f"{CORES} CPU core(s), torch {torch.__version__}\n")
    gradings(args.gradings)
    one_layer(args)
    all_gathers(args)


if __name__ == "__main__":
    main()
