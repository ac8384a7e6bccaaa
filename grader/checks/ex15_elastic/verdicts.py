"""Exercise 15's verdicts on the records every worker left: exits, resumes, atomic snapshots, who wrote the
path, shards, set_epoch, final parameters, the snapshot's contents, devices (pure functions of the records)."""

from __future__ import annotations

import os
import re

from grader.rank import untrusted
from grader.rank.drivers.ex15_elastic import (ALONE, BATCH_SIZE, EPOCHS, KILLED_BEFORE_RENAME, KILLED_WRITING,
                                             KILL_EPOCH, NUM_SAMPLES, SNAPSHOT, TOLERANCE, WORLD_SIZE, _error_text)


def _record(g, check_id: str, ok: bool, job: str, message: str = "", rank: int | None = None,
            world: int = WORLD_SIZE) -> bool:
    return g.record(check_id, ok, f"{job}: {message}", rank=rank, world_size=world)


def _last_line(log: str) -> str:
    lines = [ln for ln in log.strip().splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return short_error((errors or lines or [""])[-1].strip())[:300]


def check_exit(g, name: str, job: dict) -> None:
    for node, agent in sorted(job["agents"].items()):
        code = agent["returncode"]
        if code is None and agent.get("lingered_s") is not None:
            _record(g, "job-exits-0", False, name, f"the torchrun agent of node {node} had not exited "
                    f"{agent['lingered_s']:.0f} s after the job's last worker ended (an agent waits at its exit for "
                    f"the other nodes), and the grader stopped it; its last words: "
                    f"{_last_line(agent['log'])}")
        elif code != 0:
            _record(g, "job-exits-0", False, name, f"the torchrun agent of node {node} exited with code {code}; "
                    f"its last words: {_last_line(agent['log'])}")
    g.record("job-exits-0", True)


def _attempts(job: dict) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for w in job["workers"]:
        out.setdefault(w["attempt"], []).append(w)
    return out


def _kill(job: dict) -> dict | None:
    return next((w for w in job["workers"] if w["killed"]), None)


def _steps_per_epoch(job: dict) -> int:
    return NUM_SAMPLES // (job["world"] * BATCH_SIZE)


def _why_no_kill(job: dict) -> str:
    plan = job["plan"]
    target = next((w for w in _attempts(job).get(0, []) if w["rank"] == plan["rank"]), None)
    if target is None:
        return f"no worker with RANK {plan['rank']} started"
    if "after_step" in plan:
        return (f"{who(target)} took {target['steps']} optimizer step(s), never reaching step {plan['after_step']} "
                f"(epoch {KILL_EPOCH}, step 2 of {_steps_per_epoch(job)}), where the grader kills it")
    return (f"{who(target)} took {target['steps']} optimizer step(s), and after step {plan['write_after_step']} "
            f"(the end of epoch {KILL_EPOCH}) it neither wrote {SNAPSHOT} (the --snapshot path) nor renamed a file "
            "onto it; the grader kills it there")


def _by_rank(workers: list[dict]) -> list[dict]:
    return sorted(workers, key=lambda w: (w["rank"] is None, w["rank"] if w["rank"] is not None else 0))


def check_resume(g, name: str, job: dict, restart_resumed: bool | None = None) -> bool:
    """After the kill every worker continues from the last complete snapshot: after torchrun's restart,
    and after the relaunch of the whole job (ALONE's attempt 1, TORCHELASTIC_RESTART_COUNT=0).

    ``restart_resumed``: for the relaunch, whether every worker resumed after torchrun's restart.
    Returns whether this job's workers resumed.
    """
    world, relaunch = job["world"], name == ALONE
    again = "after the relaunch" if relaunch else "after the restart"
    started = "when the job was launched again" if relaunch else "when the workers started again"
    if _kill(job) is None:
        return _record(g, "resumes-from-snapshot", False, name, f"the grader's kill never happened: "
                       f"{_why_no_kill(job)}", world=world)
    restarted = _attempts(job).get(1, [])
    if not restarted:
        return _record(g, "resumes-from-snapshot", False, name, "after the kill, the workers were never started "
                       "again", world=world)
    found = restarted[0]["found"]
    if not found.get("exists"):
        return _record(g, "resumes-from-snapshot", False, name, f"{started} there was no snapshot at --snapshot "
                       f"{SNAPSHOT}: nothing to resume from", world=world)
    if found.get("error"):
        return _record(g, "resumes-from-snapshot", False, name, f"{started}, the snapshot ({found.get('size')} "
                       f"bytes) could not be read: {first_sentence(found['error'])}", world=world)
    saved = found.get("epoch")
    resume_at = saved + 1 if isinstance(saved, int) else None
    snapshot = snapshot_words(found)
    path = os.path.abspath(snapshot_at(job))
    loaded = {id(w): [ld for ld in w["loads"] if ld.get("path") == path] for w in restarted}
    resumed = [w for w in _by_rank(restarted) if any(not ld.get("error") for ld in loaded[id(w)])]
    for w in _by_rank(restarted):
        loads = loaded[id(w)]
        trained = [e["epoch"] for e in w["epochs"]]
        if not loads:
            if relaunch:
                message = (f"the job was launched again from scratch onto {snapshot} (TORCHELASTIC_RESTART_COUNT="
                           f"{w['restart_count']}, as when a scheduler requeues a job), and {who(w)} never loaded "
                           f"it and trained {len(trained)} epoch(s) from the start")
                message += (", although after torchrun's restart (TORCHELASTIC_RESTART_COUNT=1) the workers did "
                            "resume: resume whenever the snapshot exists, whatever the restart count says"
                            if restart_resumed else f": load it whenever it exists and continue at epoch {resume_at}")
            else:
                message = (f"{again} {who(w)} never loaded {snapshot} and trained {len(trained)} epoch(s) "
                           f"(sampler epochs {trained}), from the start")
                if resumed:
                    other = resumed[0]
                    began = other["epochs"][0]["epoch"] if other["epochs"] else None
                    message += (f", while {who(other)} loaded it and began with epoch {began}: every worker "
                                "must load the snapshot, or they train different epochs side by side")
                else:
                    message += f": load it when it exists and continue at epoch {resume_at}"
            return _record(g, "resumes-from-snapshot", False, name, message, rank=w["rank"], world=world)
        failed = next((ld for ld in loads if ld.get("error")), None)
        if failed:
            return _record(g, "resumes-from-snapshot", False, name, f"{again} {who(w)}'s torch.load of the "
                           f"snapshot raised {first_sentence(failed['error'], 200)}", rank=w["rank"], world=world)
        # Resuming is loading and then beginning where the snapshot left off. A worker that did so and
        # then failed (a peer's crash, its own later mistake) resumed: job-exits-0 and
        # matches-uninterrupted judge the rest, so this verdict does not depend on when that failure came.
        if not trained and (resume_at is None or resume_at < EPOCHS):
            ended = f": main() ended with {short_error(w['error'])}" if w["error"] else ""
            return _record(g, "resumes-from-snapshot", False, name, f"{again} {who(w)} loaded {snapshot} but "
                           f"trained no epoch after it{ended}", rank=w["rank"], world=world)
        if resume_at is not None and trained and len(set(trained)) == len(trained) and trained[0] != resume_at:
            return _record(g, "resumes-from-snapshot", False, name,
                           f"{again} {who(w)} loaded {snapshot} and began with epoch {trained[0]}, expected "
                           f"{resume_at} (the saved epoch + 1)", rank=w["rank"], world=world)
        if w["finished"] and resume_at is not None and len(trained) != EPOCHS - resume_at:
            return _record(g, "resumes-from-snapshot", False, name,
                           f"{again} {who(w)} loaded {snapshot} but then trained {len(trained)} epoch(s) (sampler "
                           f"epochs {trained}); continuing at epoch {resume_at} leaves {EPOCHS - resume_at} of the "
                           f"{EPOCHS}", rank=w["rank"], world=world)
    return g.record("resumes-from-snapshot", True)


def check_atomic(g, jobs: dict) -> None:
    """At every moment the snapshot path holds a complete snapshot.

    Two observations. The relaunch after ALONE's kill, which lands where the new snapshot reaches the
    path (half-way through writing the path itself, or just before a file is renamed onto it), finds
    the previous snapshot whole. And no worker of any job writes the path itself: while such a write
    lasts the path holds part of a snapshot, whenever the worker dies; nor renames onto it a file from
    another folder, which on a cluster is another file system (EXDEV).
    """
    alone = jobs[ALONE]
    path = os.path.abspath(snapshot_at(alone))
    killed = _kill(alone)
    why = killed["killed"].get("why") if killed else None
    if why not in (KILLED_WRITING, KILLED_BEFORE_RENAME):
        _record(g, "snapshot-atomic", False, ALONE, f"the grader's kill never happened: {_why_no_kill(alone)}",
                world=alone["world"])
        return
    relaunched = _attempts(alone).get(1, [])
    found = relaunched[0]["found"] if relaunched else {}
    at = killed["killed"].get("epoch", KILL_EPOCH)  # the sampler's epoch at the kill: the one being saved
    when = f"{why} (the snapshot of epoch {at})"
    if why == KILLED_WRITING:
        direct = [r for r in killed["writes"] if r.get("path") == path and r.get("op") != "rename"]
        how = _direct_write_words(direct[-1]) if direct else f"a write onto {SNAPSHOT}"
        when = f"while it wrote the snapshot of epoch {at} onto {SNAPSHOT} itself ({how})"
    message = None
    if not relaunched:
        message = "the worker was not launched again after the kill"
    elif not found.get("exists") and len([r for r in killed["writes"] if r.get("path") == path]) <= 1:
        message = (f"{who(killed)} was killed {when}, the first time anything reached {SNAPSHOT}: there was no "
                   f"earlier snapshot to resume from. Save one at the end of every epoch")
    elif not found.get("exists"):
        message = (f"{who(killed)} was killed {when}, and the relaunched worker found no snapshot at all: the "
                   f"one of epoch {KILL_EPOCH - 1} was gone (removed or renamed away) before the new one was in "
                   "place. os.replace the new file onto the path, which swaps it in one step")
    elif found.get("error"):
        copied = killed["killed"].get("op") == "open"
        message = (f"{who(killed)} was killed {when}, and the relaunched worker found a torn file at the path "
                   f"({found.get('size')} bytes that do not load: {first_sentence(found['error'])}): the snapshot "
                   f"of epoch {KILL_EPOCH - 1} had been overwritten in place. Write the new snapshot to a temporary "
                   "file in the same folder, then os.replace it onto the path"
                   + (" (copying it onto the path, as shutil.copyfile does, writes the path in place too)"
                      if copied else ""))
    if message is not None:
        _record(g, "snapshot-atomic", False, ALONE, message, world=alone["world"])
        return
    for name, job in jobs.items():
        path = os.path.abspath(snapshot_at(job))
        for w in sorted(job["workers"], key=lambda w: (w["attempt"], w["rank"] is None, w["rank"] or 0)):
            away = [r for r in w["writes"] if r.get("op") == "rename" and r.get("path") == path
                    and not same_folder(str(r.get("src", "")), path)]
            if away:
                _record(g, "snapshot-atomic", False, name, f"attempt {w['attempt']}: {who(w)} {_rename_words(away[0])}",
                        rank=w["rank"], world=job["world"])
                return
            direct = [r for r in w["writes"] if r.get("path") == path and r.get("op") != "rename"]
            if direct:
                _record(g, "snapshot-atomic", False, name, f"attempt {w['attempt']}: {who(w)} wrote {SNAPSHOT} "
                        f"itself ({_direct_write_words(direct[0])}): for as long as that write lasts the path "
                        "holds part of a snapshot, and a worker killed then leaves it torn. Write a temporary file "
                        "in the same folder and os.replace it onto the path", rank=w["rank"], world=job["world"])
                return
    g.record("snapshot-atomic", True)


def same_folder(a: str, b: str) -> bool:
    """Whether two paths lie in the same folder (symbolic links followed)."""
    return os.path.realpath(os.path.dirname(os.path.abspath(a))) == os.path.realpath(os.path.dirname(os.path.abspath(b)))


def _rename_words(rename: dict) -> str:
    """A rename onto the snapshot from another folder, in words: what it does on a cluster."""
    line = f" (line {rename['line']}: {rename['code']})" if rename.get("line") else ""
    return (f"renamed {rename.get('src')} onto {SNAPSHOT}{line}: the temporary file was written in "
            f"{os.path.dirname(str(rename.get('src')))}, not in the snapshot's folder. On a cluster the snapshot "
            "lives on shared storage and the temporary folder (/tmp) on each node's own disk: os.replace across "
            "two file systems fails with OSError EXDEV (Invalid cross-device link), and shutil.move falls back to "
            "copying onto the path, which writes it in place. Write the temporary file beside the snapshot (the "
            "same folder, e.g. args.snapshot + '.tmp'), then os.replace it onto the path")


def _direct_write_words(write: dict) -> str:
    """A write onto the snapshot path itself, in words, with the learner's line when known."""
    what = f"torch.save onto {SNAPSHOT}" if write.get("op") == "torch.save" else f"opened {SNAPSHOT} for writing"
    if write.get("line"):
        what += f", line {write['line']}" + (f": {write['code']}" if write.get("code") else "")
    return what


def check_writers(g, name: str, job: dict) -> None:
    from grader.rank import probes

    path = os.path.abspath(snapshot_at(job))
    workers = job["workers"]
    writers = probes.writers_of(path, [w["writes"] for w in workers])
    if not writers:
        _record(g, "rank0-writes-only", False, name, f"no worker wrote the snapshot ({SNAPSHOT}, given as "
                "--snapshot)", world=job["world"])
        return
    for index, records in sorted(writers.items()):
        w = workers[index]
        if w["rank"] != 0:
            how = "; ".join(sorted({probes.describe_write(r, path).replace("the checkpoint", "the snapshot")
                                    for r in records}))
            note = " (it is LOCAL_RANK 0 of another node: is the writer chosen by LOCAL_RANK?)" \
                if w["local_rank"] == 0 and w["group_rank"] not in (0, None) else ""
            _record(g, "rank0-writes-only", False, name, f"attempt {w['attempt']}: {who(w)} wrote the snapshot "
                    f"({how}); only global rank 0 may write it{note}", rank=w["rank"], world=job["world"])
            return
    g.record("rank0-writes-only", True)


def check_shards(g, name: str, job: dict) -> None:
    """In each epoch of each attempt, the workers trained on disjoint samples, all of them together.

    The k-th epoch of an attempt is compared across the workers that drew the same sampler epoch
    there: workers at different epochs (one resumed from the snapshot, another started over) are
    not a sampler's mistake, and resumes-from-snapshot says what happened.
    """
    world, per_epoch = job["world"], _steps_per_epoch(job)
    for attempt, workers in sorted(_attempts(job).items()):
        for k in range(max((len(w["epochs"]) for w in workers), default=0)):
            at_k = [w for w in _by_rank(workers) if k < len(w["epochs"])]
            by_epoch: dict = {}
            for w in at_k:
                by_epoch.setdefault(w["epochs"][k]["epoch"], []).append(w)
            owner: dict[int, dict] = {}
            for same_epoch in by_epoch.values():
                owner = {}
                for w in same_epoch:
                    for i in w["epochs"][k]["indices"]:
                        other = owner.get(i)
                        if other is not None and other is not w:
                            _record(g, "sampler-global-rank", False, name, _shared_shard(attempt, k, other, w),
                                    rank=w["rank"], world=world)
                            return
                        owner[i] = w
            complete = len(workers) == world and len(at_k) == world and len(by_epoch) == 1 and \
                all(w["epochs"][k]["steps"] == per_epoch for w in at_k)
            if complete and len(owner) < NUM_SAMPLES:
                missing = sorted(set(range(NUM_SAMPLES)) - set(owner))
                _record(g, "sampler-global-rank", False, name, f"attempt {attempt}, epoch {k + 1} of the attempt: "
                        f"{len(missing)} of {NUM_SAMPLES} samples were never trained on (e.g. {missing[:5]}): the "
                        f"sampler needs num_replicas=WORLD_SIZE ({world}) and rank=RANK", world=world)
                return
    g.record("sampler-global-rank", True)


def _shared_shard(attempt: int, k: int, a: dict, b: dict) -> str:
    """Two workers that drew the same sampler epoch trained on some of the same samples: why, as far as seen."""
    ea, eb = a["epochs"][k], b["epochs"][k]
    same = sorted(set(ea["indices"]) & set(eb["indices"]))
    where = "two nodes got the same shard" if a["node"] != b["node"] else "two workers of one node got the same shard"
    told = ""
    if eb.get("rank") is not None:
        told = (f"; their DistributedSamplers had rank={ea.get('rank')} and rank={eb.get('rank')}, "
                f"num_replicas={ea.get('num_replicas')} and {eb.get('num_replicas')}")
        if eb.get("rank") == b["local_rank"] and b["local_rank"] != b["rank"]:
            told += f": {who(b)} gave its LOCAL_RANK where its RANK belongs (the rank among all nodes' workers)"
        elif ea.get("rank") != eb.get("rank") and ea.get("num_replicas") == eb.get("num_replicas"):
            if ea.get("seed") != eb.get("seed"):
                told += (f", but seed={ea.get('seed')} and seed={eb.get('seed')}: each draws its shard from a "
                         "different permutation; every worker needs the same seed (seed=SEED)")
            elif ea.get("shuffle") != eb.get("shuffle"):
                told += (f", but shuffle={ea.get('shuffle')} and shuffle={eb.get('shuffle')}: each draws its shard "
                         "from a different order")
    return (f"attempt {attempt}, sampler epoch {ea.get('epoch')} (epoch {k + 1} of the attempt): {who(a)} and "
            f"{who(b)} both trained on samples {same[:6]}{'...' if len(same) > 6 else ''} ({len(same)} in common): "
            f"{where}{told}")


def check_set_epoch(g, name: str, job: dict) -> None:
    for w in sorted(job["workers"], key=lambda w: (w["attempt"], w["rank"] is None, w["rank"] or 0)):
        epochs = [e["epoch"] for e in w["epochs"]]
        if len(set(epochs)) != len(epochs):
            _record(g, "set-epoch", False, name, f"attempt {w['attempt']}: {who(w)} trained {len(epochs)} epochs "
                    f"with the sampler at epoch {epochs}, so they repeat one order: call sampler.set_epoch(epoch) "
                    "before each epoch" + ("" if w["set_epoch"] else " (set_epoch was never called)"),
                    rank=w["rank"], world=job["world"])
            return
    g.record("set-epoch", True)


def check_final(g, name: str, job: dict, reference: dict) -> None:
    from grader.compare import largest_difference

    world = job["world"]
    last = max(_attempts(job).items(), default=(0, []))[1]
    if len(last) != world:
        _record(g, "matches-uninterrupted", False, name, f"the last attempt had {len(last)} worker(s), expected "
                f"{world}", world=world)
        return
    for w in _by_rank(last):
        if not w["finished"]:
            why = w["error"] or "no end was recorded"
            _record(g, "matches-uninterrupted", False, name, f"{who(w)} of attempt {w['attempt']} did not finish "
                    f"main(): {short_error(why)}", rank=w["rank"], world=world)
            return
        final = read_final(w["final"])
        if final is None:
            _record(g, "matches-uninterrupted", False, name, f"{who(w)}: the model built by build_model() could "
                    "not be read after main() returned", rank=w["rank"], world=world)
            return
        found = largest_difference(final, reference)
        if found is not None and (found.reason != "values" or found.max_abs > TOLERANCE):
            _record(g, "matches-uninterrupted", False, name, f"after the job, {who(w)}'s parameters differ from "
                    f"{EPOCHS} epochs of training without a failure: {found}", rank=w["rank"], world=world)
            return
    g.record("matches-uninterrupted", True)


def check_snapshot(g, name: str, job: dict) -> None:
    """The snapshot left at the end: what the next restart would resume from."""
    world = job["world"]
    if not untrusted.exists(snapshot_at(job)):
        _record(g, "snapshot-complete", False, name, f"there is no snapshot at --snapshot {SNAPSHOT} after the job",
                world=world)
        return
    try:
        snapshot = untrusted.load_tensors(snapshot_at(job))
    except untrusted.Unreadable as exc:
        _record(g, "snapshot-complete", False, name, f"the snapshot left after the job does not load with "
                f"weights_only=True: {first_sentence(_error_text(exc))}", world=world)
        return
    keys = sorted(map(str, snapshot)) if isinstance(snapshot, dict) else None
    missing = [k for k in ("model", "optimizer", "epoch") if keys is None or k not in snapshot]
    if missing:
        held = keys if keys is not None else type(snapshot).__name__
        _record(g, "snapshot-complete", False, name, f"the snapshot holds {held}; missing {missing}"
                + (": without the optimizer's state, SGD's momentum starts again from zero after a restart"
                   if "optimizer" in missing else ""), world=world)
        return
    model, optimizer, epoch = snapshot["model"], snapshot["optimizer"], snapshot["epoch"]
    if epoch != EPOCHS - 1:
        _record(g, "snapshot-complete", False, name, f"the last snapshot says epoch {epoch!r}; the last epoch "
                f"finished is {EPOCHS - 1} (0-based)", world=world)
        return
    if not isinstance(model, dict) or any(str(k).startswith("module.") for k in model):
        _record(g, "snapshot-complete", False, name, "snapshot['model'] is not the unwrapped model's state_dict "
                "(its keys start with 'module.': save model.module.state_dict(), or the model before wrapping)",
                world=world)
        return
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    if not isinstance(state, dict) or len(state) != len(model) or \
            not all(isinstance(v, dict) and "momentum_buffer" in v for v in state.values()):
        held = len(state) if isinstance(state, dict) else 0
        _record(g, "snapshot-complete", False, name, f"snapshot['optimizer'] holds state for {held} of "
                f"{len(model)} parameters: save optimizer.state_dict() (SGD's momentum buffers)", world=world)
        return
    rank0 = next((w for w in max(_attempts(job).items(), default=(0, []))[1] if w["rank"] == 0), None)
    final = read_final(rank0["final"]) if rank0 else None
    if final is not None:
        from grader.compare import first_difference

        found = first_difference(model, final)
        if found is not None:
            _record(g, "snapshot-complete", False, name, f"the last snapshot's model is not the trained model of "
                    f"RANK 0: {found}", world=world)
            return
    g.record("snapshot-complete", True)


def check_devices(g, name: str, job: dict) -> None:
    if g.backend != "nccl":
        g.skip("device-local-rank", "runs with NCCL only, on a machine with 4 GPUs (one per local rank)")
        return
    for w in job["workers"]:
        wanted = f"cuda:{w['local_rank']}"
        wrong = [d for d, _ in w["devices"] if d != wanted]
        if wrong:
            _record(g, "device-local-rank", False, name, f"{who(w)} ran its model on {wrong[0]}; expected "
                    f"{wanted}, the GPU of its LOCAL_RANK", rank=w["rank"])
            return
    g.record("device-local-rank", True)


def who(w: dict) -> str:
    if w["node"] == "alone":
        return f"RANK {w['rank']} (the only worker)"
    return f"RANK {w['rank']} (node {w['node']}, LOCAL_RANK {w['local_rank']})"


def read_final(path: str) -> dict | None:
    try:
        state = untrusted.load_tensors(path)
    except untrusted.Unreadable:
        return None
    return state if isinstance(state, dict) else None


def snapshot_at(job: dict) -> str:
    return os.path.join(job["folder"], "snapshot", SNAPSHOT)


def snapshot_words(found: dict) -> str:
    """The snapshot a worker found at start, in words."""
    if found.get("epoch") is not None:
        return f"the snapshot of epoch {found['epoch']}"
    keys = found.get("keys")
    held = f"its keys: {', '.join(keys)}" if keys is not None else f"a {found.get('type') or 'value'}, not a dict"
    return f"the snapshot (it holds no integer 'epoch'; {held})"


def first_sentence(text: str, limit: int = 160) -> str:
    return re.split(r"(?<=[.!?]) ", str(text), maxsplit=1)[0][:limit]


def short_error(text: str) -> str:
    """An error in a few words: gloo's long messages about a peer that died become one phrase."""
    for phrase in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"):
        if phrase in text:
            return f"lost a peer that died ({phrase})"
    if "connectFullMesh failed" in text:
        return "could not connect to its peers (gloo connectFullMesh failed)"
    return first_sentence(re.sub(r"\[/[^\]]*\] ?", "", text))


def exit_text(agent: dict) -> str:
    if agent["returncode"] is not None:
        return str(agent["returncode"])
    if agent.get("lingered_s") is not None:
        return f"no exit {agent['lingered_s']:.0f} s after the last worker ended (stopped by the grader)"
    return "no exit (stopped at the deadline)"
