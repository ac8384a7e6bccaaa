"""Exercise 44, right, another style: goodput from two states solved as equations (just after a checkpoint
counts, and just after a failure), each a mean over what the next failure does; the best interval by golden-
section search on that goodput, without any formula for it."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    gpus: int                  # GPUs the job runs on; any one failing stops the job
    gpu_failure_rate: float    # failures per GPU per second (one GPU's MTBF is 1 / this, in seconds)


@dataclass(frozen=True)
class Job:
    interval_s: float           # seconds of training between two checkpoints (work, not wall time)
    save_s: float               # seconds to write one checkpoint to storage
    restart_s: float            # seconds from a failure until the job runs again, before the reload
    reload_s: float             # seconds to read the last checkpoint back
    asynchronous: bool = False  # True: the checkpoint is written in the background while training goes on
    stall_s: float = 0.0        # asynchronous only: seconds training stops to copy its state to host memory


RULES = [
    (lambda c, j: c.gpus >= 1, "a job needs a GPU"),
    (lambda c, j: c.gpu_failure_rate >= 0, "a failure rate is not negative"),
    (lambda c, j: j.interval_s > 0, "an interval is some training"),
    (lambda c, j: min(j.save_s, j.restart_s, j.reload_s, j.stall_s) >= 0, "times are not negative"),
]


def _refuse(cluster, job):
    for rule, why in RULES:
        if not rule(cluster, job):
            raise ValueError(why)


def _segment(lam, length):
    """(P(a failure within `length`), E[time until that failure or the end])."""
    p = -math.expm1(-lam * length)
    return p, p / lam


def goodput(cluster: Cluster, job: Job) -> float:
    _refuse(cluster, job)
    lam = cluster.gpus * cluster.gpu_failure_rate
    stall, write = (job.stall_s, job.save_s) if job.asynchronous else (job.save_s, 0.0)
    period = stall + max(job.interval_s, write)
    if lam == 0:
        return job.interval_s / period
    recover = job.restart_s + job.reload_s
    redo = job.interval_s + stall + write   # from a reloaded checkpoint to the next one that counts

    # After a failure: recover, then redo; a failure in either comes back here.
    #   F = t_rec + p_rec F + (1 - p_rec) (t_redo + p_redo F)
    p_rec, t_rec = _segment(lam, recover)
    p_redo, t_redo = _segment(lam, redo)
    after_failure = (t_rec + (1 - p_rec) * t_redo) / (1 - p_rec - (1 - p_rec) * p_redo)
    # After a checkpoint counts: the next one a period later, unless a failure comes first.
    p, t = _segment(lam, period)
    return job.interval_s / (t + p * after_failure)


def best_checkpoint_interval(cluster: Cluster, job: Job) -> float:
    _refuse(cluster, job)
    lam = cluster.gpus * cluster.gpu_failure_rate
    if lam == 0:
        raise ValueError("a job that never fails has no best interval")
    if (job.stall_s if job.asynchronous else job.save_s) == 0 and (not job.asynchronous or job.save_s == 0):
        raise ValueError("a checkpoint that costs nothing has no best interval")

    def score(tau):
        return goodput(cluster, Job(tau, job.save_s, job.restart_s, job.reload_s, job.asynchronous, job.stall_s))

    # goodput rises, then falls, with the interval: golden-section search between 0 and 2 MTBFs.
    lo, hi = 1e-9 / lam, 2 / lam
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = score(a), score(b)
    while hi - lo > 1e-12 * hi:
        if fa < fb:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = score(b)
        else:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = score(a)
    return (lo + hi) / 2
