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

from grader.checks.interface import Grader
from grader.checks.shared import debug_job, fsdp_job
from grader.checks.shared.fsdp_job import build_model
from grader.rank.drivers.shared.stub_models import JOB_LAYERS
from grader.rank.drivers.ex28_fsdp_memory import EPOCHS, make_data, rank_main


SLACK = 1.05  # of the largest dim-0 shards' bytes: the ranks hold exactly those, give or take a step counter
OTHER_CHECKS = ("sharded-memory", "block-units", "matches-replay")


def grade(g: Grader) -> None:
    if max(g.world_sizes) < 2:
        g.stop("FSDP over one rank keeps every parameter whole and gathers nothing: what this job does wrong shows "
               "from 2 ranks on; grade with --world-size 2 or more")
    data = make_data()
    for job in debug_job.finished_jobs(g, rank_main, data, OTHER_CHECKS):
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
    """Every training forward gathers parameters in at least JOB_LAYERS + 1 all-gathers: each block's, and the
    rest of the model's, apart (one unit gathers all its parameters at once, in one all-gather)."""
    for rank, record in enumerate(records):
        gathers, step, forward = 0, 0, True
        for event in record.get("trace", []):
            if event.get("what") == "backward":
                forward = False
            elif event.get("what") == "step":
                if gathers < JOB_LAYERS + 1:
                    seen = f"{gathers} parameter all-gather(s)" if gathers else "no parameter all-gather"
                    return False, (f"rank {rank}, optimizer step {step}: the forward gathered parameters in {seen}: "
                                   f"FSDP gathered the model in {gathers} unit(s), for {JOB_LAYERS} blocks and the layers "
                                   "around them")
                gathers, step, forward = 0, step + 1, True
            elif forward:
                gathers += 1
    return True, ""


def check_saved_model(g: Grader, job: debug_job.Job, data: dict) -> None:
    """The model rank 0 saved to --out/model.pt equals one process training on the same global batches."""
    saved, why = fsdp_job.saved_model(job.run_dir)
    if saved is None:
        g.record("matches-replay", False, why, rank=0, world_size=job.world_size)
        return
    found = fsdp_job.replay_difference(saved, data, [(job.world_size, range(EPOCHS))])
    if found is None:
        g.record("matches-replay", True)
        return
    steps = len(fsdp_job.sampler_batches(job.world_size, range(EPOCHS))[0])
    g.record("matches-replay", False, f"after {steps} steps, the model rank 0 saved differs from one process "
             f"training on the same global batches: {found} (tolerance {fsdp_job.TOLERANCE:g})",
             rank=0, world_size=job.world_size)
