"""What a fully sharded rank holds, and what a step costs: FullyShardedDP beside torch's FSDP2 and DDP.

One run on gloo (world size 2 by default), on this machine's CPU, the same model for all three:
  - FullyShardedDP from solutions/11_fsdp.py (or --file, e.g. your exercises/11_fsdp.py);
  - torch's FSDP2, fully_shard on each layer and then on the root (a CPU DeviceMesh);
  - torch's DistributedDataParallel (gradient_as_bucket_view=True, so its buckets are the gradients).
For each: the median time of a training step with Adam (forward, backward, gradient synchronization,
optimizer step) after a warm-up, the three alternated so that they see the same load; the bytes a
rank holds after the step (parameters, gradients and Adam's moments, each storage once: what is
reachable from the model and the optimizer, DTensors by their local shards); and the collectives of
one step. Expected: the sharded ones hold about 1/world_size of DDP's bytes, and move about 1.5 times
its bytes (two all-gathers and a reduce-scatter where DDP has one all-reduce).

    python benchmarks/bench_fsdp.py [--world-size 2] [--reps 10] [--file exercises/11_fsdp.py]

Not a test: timings depend on the machine.
"""

import argparse
import importlib.util
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grader.rank import memory  # noqa: E402  (after the path is set)

LAYERS, WIDTH, BATCH = 8, 512, 32  # 8 x (512 x 512 + 512) = 2.10 M parameters
WARMUP = 3
COUNTED = ("all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
           "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "broadcast")


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


class Collectives:
    """Count the calls and bytes of torch.distributed's collectives (the outermost call only)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.on = False
        self.depth = 0
        for name in COUNTED:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            if self.on and self.depth == 0:
                first = args[0] if args else next(iter(kwargs.values()))
                tensors = first if isinstance(first, (list, tuple)) else [first]
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                if name == "all_gather":  # all_gather(tensor_list, tensor): the list is the output
                    nbytes = sum(t.numel() * t.element_size() for t in args[0])
                self.calls.append((name, nbytes))
            self.depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1
        return counted

    def summary(self) -> str:
        by_kind: dict[str, list[int]] = {}
        for name, nbytes in self.calls:
            kind = "all-gather" if "gather" in name else "reduce-scatter" if "scatter" in name else name
            by_kind.setdefault(kind, []).append(nbytes)
        return ", ".join(f"{len(v)} {k} ({sum(v) / 2**20:.1f} MiB)" for k, v in by_kind.items())


def rank_bytes(model, optimizer, learner_module: str) -> int:
    """Bytes of the distinct storages reachable from the model and the optimizer's state."""
    tensors = memory.reachable_tensors([model, optimizer.state], learner_module)
    return sum(s.nbytes() for s in memory.distinct_storages(tensors).values())


def worker(rank: int, world_size: int, port: int, reps: int, file: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    learner = load(Path(file))
    collectives = Collectives()
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))

    ours = learner.FullyShardedDP(make_model())
    fsdp2 = make_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in fsdp2:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(fsdp2, mesh=mesh)
    ddp = DistributedDataParallel(make_model(), gradient_as_bucket_view=True)
    setups = {
        "ours": (ours, lambda: ours.finish_gradient_synchronization(), learner.__name__),
        "fsdp2": (fsdp2, lambda: None, ""),
        "ddp": (ddp, lambda: None, ""),
    }
    optimizers = {name: torch.optim.Adam(model.parameters(), lr=1e-3) for name, (model, _, _) in setups.items()}

    def step(name):
        model, sync, _ = setups[name]
        optimizers[name].zero_grad()
        model(x).square().mean().backward()
        sync()
        optimizers[name].step()

    for _ in range(WARMUP):
        for name in setups:
            step(name)
    times = {name: [] for name in setups}
    for _ in range(reps):
        for name in setups:
            dist.barrier()
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, (model, _, module_name) in setups.items():
        collectives.calls, collectives.on = [], True
        step(name)
        collectives.on = False
        out[name] = {"seconds": statistics.median(times[name]), "collectives": collectives.summary(),
                     "bytes": rank_bytes(model, optimizers[name], module_name)}
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10, help="timed steps of each (after a warm-up)")
    parser.add_argument("--file", default=str(ROOT / "solutions" / "11_fsdp.py"),
                        help="the file whose FullyShardedDP is measured")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args.world_size, free_port(), args.reps, os.path.abspath(args.file), results),
                       nprocs=args.world_size, join=True, start_method="spawn")
    out = results.get()
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    print(f"gloo, world size {args.world_size}, {LAYERS} x Linear({WIDTH}, {WIDTH}) = {params / 1e6:.2f} M float32 "
          f"parameters, Adam, batch {BATCH} per rank; median of {args.reps} steps after {WARMUP} warm-up steps\n")
    names = {"ours": f"FullyShardedDP ({os.path.relpath(args.file, ROOT)})", "fsdp2": "torch fully_shard (FSDP2)",
             "ddp": "torch DistributedDataParallel"}
    ddp_bytes = out["ddp"]["bytes"]
    print(f"{'':44}{'step':>10}{'bytes held per rank':>26}   collectives of one step")
    for name, label in names.items():
        row = out[name]
        held = f"{row['bytes'] / 2**20:.2f} MiB ({row['bytes'] / ddp_bytes:.2f} x DDP)"
        calls = row["collectives"] or (f"all-reduces of the {params * 4 / 2**20:.1f} MiB of gradients, in buckets "
                                       "(from DDP's C++ reducer, not seen here)")
        print(f"{label:44}{row['seconds'] * 1e3:>8.1f}ms{held:>26}   {calls}")
    print(f"\nexpected bytes: DDP 16 x {params / 1e6:.2f} M = {16 * params / 2**20:.1f} MiB (parameters, gradients, "
          f"two moments); fully sharded about 1/{args.world_size} of it")


if __name__ == "__main__":
    main()
