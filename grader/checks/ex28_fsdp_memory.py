"""Exercise 28: after moving to FSDP2 each rank's memory barely drops (the blocks are passed to
fully_shard, the root never is: the embeddings, the final norm and the head stay whole on every rank,
and each rank steps them on its own gradients).

Rank side: run the script's main() under torchrun's variables (the track's job runner); at every
optimizer step, a hook of the grader's own records what the rank holds of each parameter the
optimizer steps (its local part, DTensor or not) and of its optimizer state. Grader side: each rank
holds about 1/W of the parameters and state (each parameter's dim-0 shard); FSDP gathers the blocks'
parameters unit by unit (one all-gather each, plus the root's, per step at least); the model rank 0
saves equals a replay in one process on the same global batches (SGD with momentum, written out).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from grader import probes
from grader.checks.interface import Grader, RankContext
from grader.checks.shared import debug_job
from grader.checks.shared.debug_replay import load_into, replay

VOCAB, DIM, HIDDEN, LAYERS, SEQ = 256, 32, 64, 2, 8
BATCH_SIZE = 4
LR, MOMENTUM = 0.05, 0.9
EPOCHS = 3
N_TRAIN = 48  # 2 ranks: 6 steps an epoch; 3 ranks: 4
SLACK = 1.05  # of the largest dim-0 shards' bytes: the ranks hold exactly those, give or take a step counter
TOLERANCE = 2e-5  # float32, gradients averaged by a reduce-scatter instead of in one process
OTHER_CHECKS = ("sharded-memory", "block-units", "matches-replay")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """The grader's copy of the script's model."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h).flatten(0, 1))


def build_model() -> Net:
    torch.manual_seed(0)
    return Net()


def make_data() -> dict:
    g = torch.Generator().manual_seed(28)
    tokens = torch.randint(0, VOCAB, (N_TRAIN, SEQ + 1), generator=g)
    return {"train_x": tokens[:, :-1].contiguous(), "train_y": tokens[:, 1:].contiguous()}


# --- in each rank ---------------------------------------------------------------------


def _names(params: list) -> dict[int, str]:
    """The parameters' names in the largest module that holds them all (found once, among the objects alive)."""
    import gc

    wanted = {id(p) for p in params}
    best: dict[int, str] = {}
    for obj in gc.get_objects():
        if isinstance(obj, nn.Module):
            named = {id(p): name for name, p in obj.named_parameters()}
            if wanted <= named.keys() and len(named) >= len(best):
                best = named
    return best


def _held(optimizer, names: dict[int, str]) -> list[dict]:
    """What this rank holds of each parameter the optimizer steps, and of that parameter's state."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not names:
        names.update(_names(params))
    out = []
    for p in params:
        state = optimizer.state.get(p, {})
        out.append({"name": names.get(id(p), "?"), "shape": list(p.shape), "dtensor": isinstance(p, DTensor),
                    "bytes": local(p).numel() * local(p).element_size(),
                    "state_bytes": sum(local(v).numel() * local(v).element_size() for v in state.values()
                                       if isinstance(v, torch.Tensor))})
    return out


def rank_main(ctx: RankContext) -> dict:
    """The job, with what the rank holds at each optimizer step, and a trace of FSDP's all-gathers with the
    start of each backward and each step (to count the units a forward gathers)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    held: list = []
    trace: list = []
    names: dict[int, str] = {}

    def after_step(optimizer, args, kwargs):
        held.append(_held(optimizer, names))
        trace.append({"what": "step"})

    original_backward = torch.Tensor.backward

    def backward(tensor, *args, **kwargs):
        trace.append({"what": "backward"})
        return original_backward(tensor, *args, **kwargs)

    hook = register_optimizer_step_post_hook(after_step)
    try:
        with probes.patched(torch.Tensor, "backward", backward), probes.watch_collectives(trace):
            record = debug_job.run_job(ctx, ["--data", debug_job.write_data(ctx, make_data())], epochs=EPOCHS)
    finally:
        hook.remove()
    record["held"] = held
    record["trace"] = [e for e in trace if e.get("what") or e.get("op") in probes.ALL_GATHERS]
    return record


# --- in the grader --------------------------------------------------------------------


def grade(g: Grader) -> None:
    data = make_data()
    for job in debug_job.finished_jobs(g, data, OTHER_CHECKS):
        g.record("sharded-memory", *memory_verdict(job.records, job.world_size), world_size=job.world_size)
        g.record("block-units", *units_verdict(job.records, job.world_size), world_size=job.world_size)
        check_saved_model(g, job, data)


def sharded_bytes(world_size: int) -> int:
    """What one rank holds at most of the model's parameters when each is split on dim 0 over the ranks
    (the largest shard of each, float32)."""
    total = 0
    for p in build_model().parameters():
        rest = p.numel() // p.shape[0]
        total += math.ceil(p.shape[0] / world_size) * rest * p.element_size()
    return total


def memory_verdict(records: list[dict], world_size: int) -> tuple[bool, str]:
    """At every optimizer step, every rank holds at most about the largest dim-0 shard of each parameter,
    and of its momentum buffer."""
    whole = sum(p.numel() * p.element_size() for p in build_model().parameters())
    bound = sharded_bytes(world_size)
    for rank, record in enumerate(records):
        for step, entries in enumerate(record.get("held", [])):
            params = sum(e["bytes"] for e in entries)
            state = sum(e["state_bytes"] for e in entries)
            if params <= bound * SLACK and state <= bound * SLACK:
                continue
            plain = [e for e in entries if not e["dtensor"]]
            listed = ", ".join(f"{e['name']} {e['shape']}" for e in plain[:6])
            plain_bytes = sum(e["bytes"] for e in plain)
            where = (f"; {len(plain)} of the {len(entries)} parameters the optimizer steps are plain tensors, "
                     f"whole on this rank ({plain_bytes:,} bytes): {listed}" + (", ..." if len(plain) > 6 else "")
                     if plain else "")
            return False, (f"rank {rank}, optimizer step {step}: this rank holds {params:,} bytes of parameters and "
                           f"{state:,} of optimizer state, of a model of {whole:,} bytes; its 1/{world_size} share "
                           f"is about {bound:,} of each{where}")
    return True, ""


def units_verdict(records: list[dict], world_size: int) -> tuple[bool, str]:
    """Every training forward gathers parameters in at least LAYERS + 1 all-gathers: each block's, and the
    rest of the model's, apart (one unit gathers all its parameters at once, in one all-gather)."""
    for rank, record in enumerate(records):
        gathers, step, forward = 0, 0, True
        for event in record.get("trace", []):
            if event.get("what") == "backward":
                forward = False
            elif event.get("what") == "step":
                if gathers < LAYERS + 1:
                    seen = f"{gathers} parameter all-gather(s)" if gathers else "no parameter all-gather"
                    return False, (f"rank {rank}, optimizer step {step}: the forward gathered parameters in {seen}: "
                                   f"FSDP gathered the model in {gathers} unit(s), for {LAYERS} blocks and the layers "
                                   "around them")
                gathers, step, forward = 0, step + 1, True
            elif forward:
                gathers += 1
    return True, ""


def sampler_batches(world_size: int, epochs: int) -> list[list[list[list[int]]]]:
    """per_rank[r][s]: rank r's batch (sample ids, one micro-batch) at step s, as DistributedSampler
    (shuffle, seed 0, set_epoch) and a DataLoader of BATCH_SIZE hand them out."""
    from torch.utils.data import DistributedSampler

    per_rank: list[list] = [[] for _ in range(world_size)]
    for rank in range(world_size):
        sampler = DistributedSampler(range(N_TRAIN), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            ids = list(sampler)
            per_rank[rank] += [[ids[i:i + BATCH_SIZE]] for i in range(0, len(ids), BATCH_SIZE)]
    return per_rank


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    return F.cross_entropy(model(x), y.flatten())


def check_saved_model(g: Grader, job: debug_job.Job, data: dict) -> None:
    """The model rank 0 saved to --out/model.pt equals one process training on the same global batches."""
    from grader.compare import largest_difference

    path = os.path.join(job.run_dir, "out", "model.pt")
    if not os.path.exists(path):
        g.record("matches-replay", False, "rank 0 saved no model.pt in --out after training",
                 rank=0, world_size=job.world_size)
        return
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a file the script wrote: anything may be wrong with it
        g.record("matches-replay", False, f"the model.pt rank 0 saved does not load: {type(exc).__name__}: {exc}",
                 rank=0, world_size=job.world_size)
        return
    model = build_model()
    misfit = load_into(model, {k: v for k, v in saved.items()} if isinstance(saved, dict) else {})
    if misfit:
        g.record("matches-replay", False, f"the model.pt rank 0 saved is not the script's model: {misfit}",
                 rank=0, world_size=job.world_size)
        return
    model = build_model()
    per_rank = sampler_batches(job.world_size, EPOCHS)
    replay(model, per_rank, data["train_x"], data["train_y"], lr=LR, loss_fn=loss_fn, momentum=MOMENTUM)
    found = largest_difference(saved, {k: v.detach() for k, v in model.state_dict().items()})
    if found is None or found.max_abs <= TOLERANCE:
        g.record("matches-replay", True)
        return
    g.record("matches-replay", False, f"after {len(per_rank[0])} steps, the model rank 0 saved differs from one "
             f"process training on the same global batches: {found} (tolerance {TOLERANCE:g})",
             rank=0, world_size=job.world_size)
