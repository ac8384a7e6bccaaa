"""Exercise 29: a sharded checkpoint that resumes on 2 ranks and not on 3 (each rank torch.saves its own
local shards to rank{r}.pt and copies them back: the files are as many as the ranks that saved, and
each holds that sharding's pieces).

Rank side: the track's job runner; a first job on 2 processes trains 1 epoch and saves a checkpoint
into --out/checkpoint, while the grader records every file each rank opens for writing there (an
audit hook, and torch.save, whose files are opened outside Python). At each such file it looks at what
the rank holds: its model's and momentum's own shards (their bytes), and any whole parameter among
the tensors its running code can reach; after the job each rank reads back the files it wrote. Then
a job on 2 and a job on 3 processes resume from that folder (--resume) and train epoch 1. Grader
side: every rank wrote part of the checkpoint, its own shards and no other rank's, and held no whole
parameter meanwhile; each resumed job finishes, and the model its rank 0 saves equals one process
training both epochs without stopping (epoch 0 on the first job's global batches, epoch 1 on the
resumed job's, momentum carried).
"""

from __future__ import annotations

import os

from grader.rank import untrusted
from grader.checks.interface import Grader
from grader.checks.shared import debug_job, fsdp_job
from grader.rank.drivers.ex29_reshard_resume import CHECKPOINT, EPOCHS, FIRST_EPOCHS, first_main, make_data, resume_main


FIRST_WORLD = 2
RESUMED = {2: "resumes-same-size", 3: "resumes-other-size"}
OTHER_CHECKS = ("own-files", "own-shards", "whole-model", *RESUMED.values())


def grade(g: Grader) -> None:
    data = make_data()
    first = debug_job.read_job(g, g.run(first_main, FIRST_WORLD, expect_ok=False))
    if not debug_job.check_finishes(g, first):
        debug_job.not_checked(g, first, OTHER_CHECKS)
        return
    g.record("own-files", *own_files_verdict(first.records, os.path.join(first.run_dir, "out", CHECKPOINT)),
             world_size=FIRST_WORLD)
    g.record("own-shards", *own_shards_verdict(first.records), world_size=FIRST_WORLD)
    g.record("whole-model", *whole_model_verdict(first.records), world_size=FIRST_WORLD)
    resume = os.path.join(first.run_dir, "out", CHECKPOINT)
    for world_size, check_id in RESUMED.items():
        job = debug_job.read_job(g, g.run(resume_main, world_size, kwargs={"resume": resume}, expect_ok=False))
        check_resumed(g, job, data, check_id)


def own_files_verdict(records: list[dict], folder: str) -> tuple[bool, str]:
    """Every rank of the first job wrote at least one file of the checkpoint."""
    if not untrusted.is_folder(folder):
        return False, f"after the first job there is no --out/{CHECKPOINT} folder: no checkpoint was saved"
    written = {rank: record.get("written", []) for rank, record in enumerate(records)}
    silent = [rank for rank, files in written.items() if not files]
    if not silent:
        return True, ""
    wrote = "; ".join(f"rank {r}: {', '.join(files[:4])}" + (", ..." if len(files) > 4 else "")
                      for r, files in written.items() if files) or "no rank wrote any file there"
    return False, (f"{debug_job.rank_list(silent)} wrote no file of the checkpoint in --out/{CHECKPOINT} ({wrote}): "
                   "what those ranks hold reached the files through another rank")


def _bytes_dict(value) -> dict[str, bytes]:
    """A rank's {name: bytes} as sent, anything else left out."""
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, bytes)}


def own_shards_verdict(records: list[dict]) -> tuple[bool, str]:
    """Each rank's files in the checkpoint folder hold its own shard of every large parameter (and of its
    momentum), and no other rank's: found byte for byte in the files each rank wrote."""
    files = [_bytes_dict(record.get("files")) for record in records]
    if not any(files):
        return False, f"no rank wrote a file in --out/{CHECKPOINT} that could be read back"
    for kind, key in (("shard", "prints"), ("shard of the momentum", "momentum_prints")):
        prints = [_bytes_dict(record.get(key)) for record in records]
        for name in sorted(set().union(*prints)):
            for rank, own in enumerate(prints):
                if name not in own:
                    continue
                holders = [q for q, data in enumerate(files) if any(own[name] in raw for raw in data.values())]
                others = [q for q in holders if q != rank]
                if others:
                    what = ", ".join(sorted(files[others[0]]))
                    return False, (f"rank {others[0]}'s files ({what}) hold rank {rank}'s {kind} of {name!r}: a "
                                   f"file holds more than the shards of the rank that wrote it (the whole tensor, "
                                   "gathered onto the rank that writes it), so the checkpoint is the model again in "
                                   "every rank's files")
                if rank not in holders:
                    shown = ", ".join(sorted(files[rank])) or "none"
                    return False, (f"rank {rank}'s {kind} of {name!r} is in none of the files rank {rank} wrote "
                                   f"({shown})")
    if not any(_bytes_dict(record.get("prints")) for record in records):
        return False, ("no sharded parameter was found while the checkpoint was written: the model saved is not "
                       "sharded over the ranks")
    return True, ""


def whole_model_verdict(records: list[dict]) -> tuple[bool, str]:
    """No rank held a whole parameter (or whole momentum buffer) while it wrote a file of the checkpoint."""
    for rank, record in enumerate(records):
        found = record.get("whole") if isinstance(record.get("whole"), list) else []
        for entry in found:
            if not isinstance(entry, dict) or not isinstance(entry.get("names"), list) or not entry["names"]:
                continue
            names = [str(n) for n in entry["names"]]
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            where = f" ({entry['where']})" if entry.get("where") else ""
            return False, (f"rank {rank} held the whole of {names[0]}{more} as it wrote {entry.get('file')} in "
                           f"--out/{CHECKPOINT}{where}: a rank that writes its own part of a sharded checkpoint "
                           "needs its own shards only, never the whole model gathered onto it")
    return True, ""


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
