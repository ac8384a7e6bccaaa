"""Exercise 29: a sharded checkpoint that resumes on 2 ranks and not on 3 (each rank torch.saves its own
local shards to rank{r}.pt and copies them back: the files are as many as the ranks that saved, and
each holds that sharding's pieces).

Rank side: the track's job runner; a first job on 2 processes trains 1 epoch and saves a checkpoint
into --out/checkpoint, while the grader records every file each rank opens for writing there (an
audit hook, and torch.save, whose files are opened outside Python); then a job on 2 and a job on 3
processes resume from that folder (--resume) and train epoch 1. Grader side: every rank wrote part of
the checkpoint; each resumed job finishes, and the model its rank 0 saves equals one process training
both epochs without stopping (epoch 0 on the first job's global batches, epoch 1 on the resumed job's,
momentum carried).
"""

from __future__ import annotations

import os
import sys

import torch

from grader import probes
from grader.checks.interface import Grader, RankContext
from grader.checks.shared import debug_job, fsdp_job

FIRST_EPOCHS = 1  # the first job: epoch 0, and a checkpoint after it
EPOCHS = 2  # the resumed jobs go on to this many epochs in all
FIRST_WORLD = 2
RESUMED = {2: "resumes-same-size", 3: "resumes-other-size"}
CHECKPOINT = "checkpoint"
OTHER_CHECKS = ("own-files", *RESUMED.values())


def make_data() -> dict:
    return fsdp_job.make_data(seed=29)


# --- in each rank ---------------------------------------------------------------------

_WRITES: list | None = None  # while a job runs: the files this rank opens for writing
_AUDIT_ADDED = False


def _audit(event: str, args: tuple) -> None:
    if _WRITES is None or event != "open" or len(args) < 3:
        return
    path, mode, flags = args[0], args[1], args[2]
    writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    if writing and isinstance(path, (str, bytes, os.PathLike)):
        _WRITES.append(os.fsdecode(path))


def first_main(ctx: RankContext) -> dict:
    """The first job, with the files each rank wrote under --out/checkpoint."""
    global _WRITES, _AUDIT_ADDED
    if not _AUDIT_ADDED:
        sys.addaudithook(_audit)  # cannot be removed: it records only while _WRITES is a list
        _AUDIT_ADDED = True
    _WRITES = []
    original_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            _WRITES.append(os.fsdecode(f))
        return original_save(obj, f, *args, **kwargs)

    try:
        with probes.patched(torch, "save", save), probes.patched(torch.serialization, "save", save):
            record = debug_job.run_job(ctx, ["--data", debug_job.write_data(ctx, make_data())],
                                       epochs=FIRST_EPOCHS)
    finally:
        writes, _WRITES = _WRITES, None
    folder = os.path.join(os.path.realpath(ctx.run_dir), "out", CHECKPOINT) + os.sep
    record["written"] = sorted({os.path.relpath(os.path.realpath(p), folder) for p in writes
                                if os.path.realpath(p).startswith(folder)})
    return record


def resume_main(ctx: RankContext) -> dict:
    return debug_job.run_job(ctx, ["--data", debug_job.write_data(ctx, make_data()), "--resume",
                                   ctx.kwargs["resume"]], epochs=EPOCHS)


# --- in the grader --------------------------------------------------------------------


def grade(g: Grader) -> None:
    data = make_data()
    first = debug_job.read_job(g, g.run("first_main", FIRST_WORLD, expect_ok=False))
    if not debug_job.check_finishes(g, first):
        debug_job.not_checked(g, first, OTHER_CHECKS)
        return
    g.record("own-files", *own_files_verdict(first.records, os.path.join(first.run_dir, "out", CHECKPOINT)),
             world_size=FIRST_WORLD)
    resume = os.path.join(first.run_dir, "out", CHECKPOINT)
    for world_size, check_id in RESUMED.items():
        job = debug_job.read_job(g, g.run("resume_main", world_size, kwargs={"resume": resume}, expect_ok=False))
        check_resumed(g, job, data, check_id)


def own_files_verdict(records: list[dict], folder: str) -> tuple[bool, str]:
    """Every rank of the first job wrote at least one file of the checkpoint."""
    if not os.path.isdir(folder):
        return False, f"after the first job there is no --out/{CHECKPOINT} folder: no checkpoint was saved"
    written = {rank: record.get("written", []) for rank, record in enumerate(records)}
    silent = [rank for rank, files in written.items() if not files]
    if not silent:
        return True, ""
    wrote = "; ".join(f"rank {r}: {', '.join(files[:4])}" + (", ..." if len(files) > 4 else "")
                      for r, files in written.items() if files) or "no rank wrote any file there"
    return False, (f"{debug_job.rank_list(silent)} wrote no file of the checkpoint in --out/{CHECKPOINT} ({wrote}): "
                   "what those ranks hold reached the files through another rank")


def check_resumed(g: Grader, job: debug_job.Job, data: dict, check_id: str) -> None:
    """The resumed job finished, and the model its rank 0 saved is the uninterrupted training's."""
    world_size = job.world_size
    if not job.ok:
        g.record(check_id, False, f"resumed from the checkpoint of {FIRST_WORLD} processes on {world_size}, the job "
                 f"failed: {debug_job.ends_message(job)}",
                 rank=next(e.rank for e in job.ends if not e.finished), world_size=world_size)
        return
    saved, why = fsdp_job.saved_model(job.run_dir)
    if saved is None:
        g.record(check_id, False, f"resumed on {world_size} processes: {why}", rank=0, world_size=world_size)
        return
    phases = [(FIRST_WORLD, range(FIRST_EPOCHS)), (world_size, range(FIRST_EPOCHS, EPOCHS))]
    found = fsdp_job.replay_difference(saved, data, phases)
    if found is None:
        g.record(check_id, True)
        return
    g.record(check_id, False, f"resumed on {world_size} processes from the checkpoint {FIRST_WORLD} saved after epoch "
             f"{FIRST_EPOCHS - 1}, the model rank 0 saved at the end differs from one process training all "
             f"{EPOCHS} epochs without stopping: {found} (tolerance {fsdp_job.TOLERANCE:g})",
             rank=0, world_size=world_size)

