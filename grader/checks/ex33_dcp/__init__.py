"""Exercise 33: save and load with torch.distributed.checkpoint (DCP) under FSDP2, asynchronously.

Rank side (rank.py): a save job on the first world size (2 by default) trains the stub's model,
sharded with fully_shard, with AdamW, and calls the learner's save into a resume folder after steps
9 and 10 (the disk slow for background threads, so that a save that returns before its files are
written is seen doing so), trains on to step 12, waits for the background writes, saves into a kill
folder after step 12, and is killed half-way through a save after step 13. Every rank records its
writes and renames, the collectives of background threads and the group they use (one on the
training's group is refused: left to run it aborts or hangs the job), whether it held a whole
parameter at any moment of a save (measured from the storages alive), and its shards. A load job
on each other world size (3 and 4) loads both folders into fresh models and optimizers and trains
steps 11 and 12 after the resume folder's checkpoint.

Grader side: the job that never stopped, put together from the save job's shards, is what every
load is compared with; the files of the newest resume save are read for each rank's shard; the
rest comes from the records (verdicts.py holds the verdicts).
"""

from __future__ import annotations

import os

from grader.rank import untrusted, wire
from grader.checks.ex33_dcp import verdicts
from grader.rank.drivers.ex33_dcp import (KILL, KILL_SAVES, KILLED, LAST_STEP, OBSERVATIONS, RESUME, RESUME_SAVES,
                                         build_model, load_main, save_main)
from grader.checks.ex33_dcp.reference import large_parameters, shapes
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.memory import tensor_bytes


def read_records(run_dir: str, world_size: int) -> list[dict] | None:
    """Every rank's observations of the save job (written to files: the job ends killed), or None;
    read as the ranks' messages are, within one budget for all of them (wire.Unreadable otherwise)."""
    records = []
    budget = wire.Budget()
    for rank in range(world_size):
        path = os.path.join(run_dir, OBSERVATIONS.format(rank=rank))
        if not untrusted.exists(path):
            return None
        try:
            records.append(wire.loads(untrusted.read_bytes(path, budget.bytes), budget))
        except untrusted.Unreadable as exc:
            raise wire.Unreadable(str(exc)) from None
    return records


def read_folder(folder: str, limit: int = wire.MAX_BYTES) -> dict[str, bytes]:
    """Every regular file under ``folder`` (links and FIFOs left out, never followed), by absolute path;
    untrusted.Unreadable when they hold more than ``limit`` bytes together."""
    if not untrusted.exists(folder):
        return {}
    files, left = {}, limit
    for path in untrusted.list_files(folder, recursive=True):
        files[os.path.abspath(path)] = data = untrusted.read_bytes(path, left)
        left -= len(data)
    return files


def read_notes(run_dir: str, world_size: int) -> dict[int, str]:
    """The file each rank of the save job was opening when it was killed."""
    notes = {}
    for rank in range(world_size):
        path = os.path.join(run_dir, KILLED.format(rank=rank))
        if untrusted.exists(path):
            notes[rank] = untrusted.clean_line(untrusted.read_text(path, 4096).strip())
    return notes


def grade(g: Grader) -> None:
    save_size = g.world_sizes[0]
    load_sizes = list(g.world_sizes[1:]) or [save_size + 1 if g.backend == "gloo" else save_size]
    started = timelines.clock()
    saved = g.run(save_main, save_size, expect_ok=False)
    try:
        records = read_records(saved.run_dir, save_size)
    except wire.Unreadable as exc:  # each rank wrote its file itself: the submission's failure, whatever it says
        g.stop(f"the save job's records cannot be read: {exc}", world_size=save_size)
    if records is None:
        g.stop_on_failures(saved)
        g.stop("the save job ended before it could report what it saw", world_size=save_size)
    timelines.keep_results(g, records, f"the save job, world size {save_size}", save_size, started)
    if not verdicts.check_own_group(g, records, save_size):
        for check_id in verdicts.AFTER_GROUP:
            g.not_checked(check_id, "own-group", "the background saves failed", world_size=save_size)
        return
    failed = verdicts.first_save_error(records)
    if failed is not None:
        rank, entry = failed
        g.stop(f"rank {rank}: save(path, model, optimizer, step={entry['step']}) raised {entry['error']}",
               rank=rank, world_size=save_size)
    verdicts.check_async(g, records, save_size)
    verdicts.check_waits(g, records, save_size)
    try:
        files = read_folder(os.path.join(saved.run_dir, RESUME))
    except untrusted.Unreadable as exc:
        g.stop(f"the resume folder cannot be read: {exc}", world_size=save_size)
    verdicts.check_own_shards(g, records, files, save_size, large_parameters())
    sizes = shapes()
    expected = verdicts.expected_states(records, sizes)
    initial = {name: p.detach() for name, p in build_model().named_parameters()}
    newest, killed_after = RESUME_SAVES[-1], KILL_SAVES[0]
    prints = {folder: {name: tensor_bytes(expected["params"][step][name]) for name in large_parameters()}
              for folder, step in ((RESUME, newest), (KILL, killed_after))}
    folders = {folder: os.path.join(saved.run_dir, folder) for folder in (RESUME, KILL)}
    notes = read_notes(saved.run_dir, save_size)
    held = [dict(entry, rank=rank, world_size=save_size) for rank, record in enumerate(records)
            for entry in record["memory"]]
    for world_size in load_sizes:
        # The kill folder is loaded once, on the first of them: it is about the files, not the sizes.
        load = [RESUME, KILL] if world_size == load_sizes[0] else [RESUME]
        loaded = g.run(load_main, world_size, kwargs={"folders": folders, "fingerprints": prints, "load": load})
        timelines.keep(g, loaded, f"the load, world size {world_size}")
        loads = loaded.results()
        verdicts.check_returns_step(g, loads, newest, world_size)
        verdicts.check_resume(g, loads, expected, initial, sizes, newest, LAST_STEP, save_size, world_size)
        verdicts.check_optimizer(g, loads, expected, sizes, newest, world_size)
        if KILL in load:
            verdicts.check_kill(g, loads, expected, initial, notes, killed_after, world_size)
        held += [dict(entry, rank=rank, world_size=world_size) for rank, load in enumerate(loads)
                 for entry in load["memory"]]
    verdicts.check_memory(g, held, sizes, [save_size, *load_sizes])
    if load_sizes == [save_size]:
        g.section("not resharded", f"NCCL grades one world size here ({save_size}): the checkpoint was loaded on as "
                  "many ranks as saved it")
