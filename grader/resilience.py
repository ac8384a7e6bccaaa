"""The kit's model of a training job that fails and restarts: goodput, the best checkpoint interval
and a seeded simulation of failures. Exercise 44 grades against it and the ``resilience`` quiz topic
computes its answers from it; pure Python.

The model (exercise 44's statement says the same to the learner):

* each of ``gpus`` GPUs fails at random, exponentially, at ``gpu_failure_rate`` failures a second;
  training is synchronous, so the job stops when any GPU fails: the job fails at
  ``lam = gpus * gpu_failure_rate`` (the first of N exponential clocks is an exponential clock of
  N times the rate), a failed GPU is replaced at once, and a failure can strike at any moment:
  while training, saving, restarting or reloading;
* the job trains ``interval_s`` seconds of work, then checkpoints. A blocking save stops training
  for ``save_s``; the checkpoint counts once the save ends. An asynchronous save stops training for
  ``stall_s`` (the copy of the state to host memory), then writes for ``save_s`` in the background
  while training goes on; the checkpoint counts once written (a partly written checkpoint has no
  ``.metadata`` and is never loaded), a save starts only when the previous one is written (training
  waits for it), and a failure loses the write in flight;
* after a failure the job restarts (``restart_s``), then reloads the last checkpoint that counts
  (``reload_s``); a failure during either starts the recovery over; the work since that checkpoint
  is lost;
* goodput is the long-run fraction of wall time whose work ends up in a checkpoint that counts
  (Llama 3's "effective training time": time spent on useful training over the elapsed time).

Exactly (renewal reward over the cycles between failures), with S the stall (``save_s`` when
blocking), C the background write (0 when blocking), b = restart + reload:

    goodput = lam tau e^(-lam (b + tau + S + C)) / (1 - e^(-lam (S + max(tau, C))))

to first order 1 - S / tau - lam (tau / 2 + C + b), whose best interval is Young's sqrt(2 S / lam)
(Young 1974; Daly's higher-order estimate adds the next terms); the exact best interval solves
(1 - lam tau) e^(lam (tau + S)) = 1, is bounded below by C (saves cannot overlap) and above by 1/lam.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# --- the job ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    gpus: int                  # GPUs the job runs on; any one failing stops it
    gpu_failure_rate: float    # failures per GPU per second (one GPU's MTBF is 1 / this, in seconds)


@dataclass(frozen=True)
class Job:
    interval_s: float          # seconds of training between two checkpoints (work, not wall time)
    save_s: float              # seconds to write one checkpoint to storage
    restart_s: float           # seconds from a failure until the job trains again, before the reload
    reload_s: float            # seconds to read the last checkpoint back
    asynchronous: bool = False  # write in the background while training goes on
    stall_s: float = 0.0       # asynchronous only: seconds training stops to copy the state to host memory


YEAR_S = 365.25 * 86400
DAY_S = 86400.0


def validate(cluster: Cluster, job: Job) -> None:
    """ValueError for a cluster or job that cannot exist."""
    if not isinstance(cluster.gpus, int) or isinstance(cluster.gpus, bool) or cluster.gpus < 1:
        raise ValueError(f"gpus must be a whole number of at least 1, not {cluster.gpus!r}")
    if not cluster.gpu_failure_rate >= 0 or math.isinf(cluster.gpu_failure_rate):
        raise ValueError(f"gpu_failure_rate must be a finite rate of at least 0, not {cluster.gpu_failure_rate!r}")
    if not job.interval_s > 0 or math.isinf(job.interval_s):
        raise ValueError(f"interval_s must be a positive number of seconds, not {job.interval_s!r}")
    for name in ("save_s", "restart_s", "reload_s", "stall_s"):
        value = getattr(job, name)
        if not value >= 0 or math.isinf(value):
            raise ValueError(f"{name} must be a finite number of seconds of at least 0, not {value!r}")


def failure_rate(cluster: Cluster) -> float:
    """The job's failures per second: any GPU failing stops it."""
    return cluster.gpus * cluster.gpu_failure_rate


def stall(job: Job) -> float:
    """Seconds training stops at each checkpoint."""
    return job.stall_s if job.asynchronous else job.save_s


def write(job: Job) -> float:
    """Seconds a checkpoint is written after training resumes (0 when the save blocks)."""
    return job.save_s if job.asynchronous else 0.0


def recovery(job: Job) -> float:
    return job.restart_s + job.reload_s


# --- goodput --------------------------------------------------------------------------------------------


def goodput(cluster: Cluster, job: Job) -> float:
    """The long-run fraction of wall time spent on work a checkpoint keeps (the exact model)."""
    validate(cluster, job)
    lam, tau, s, c, b = failure_rate(cluster), job.interval_s, stall(job), write(job), recovery(job)
    period = s + max(tau, c)  # checkpoint to checkpoint without failures: saves never overlap
    if lam == 0:
        return tau / period
    return lam * tau * math.exp(-lam * (b + tau + s + c)) / -math.expm1(-lam * period)


def first_order_goodput(cluster: Cluster, job: Job) -> float:
    """Young's first-order estimate: the stall per checkpoint, half an interval, the write and the
    recovery lost per failure, each failure counted once."""
    validate(cluster, job)
    lam, tau = failure_rate(cluster), job.interval_s
    return 1 - stall(job) / tau - lam * (tau / 2 + write(job) + recovery(job))


def young_daly_interval(cluster: Cluster, job: Job) -> float:
    """sqrt(2 x stall x MTBF): the first-order best interval (Young 1974; the first term of Daly's estimate)."""
    validate(cluster, job)
    return math.sqrt(2 * stall(job) / failure_rate(cluster))


def best_checkpoint_interval(cluster: Cluster, job: Job) -> float:
    """The interval that maximises :func:`goodput` (``job.interval_s`` is not read)."""
    validate(cluster, job)
    lam, s, c = failure_rate(cluster), stall(job), write(job)
    if lam == 0:
        raise ValueError("a job that never fails has no best checkpoint interval: checkpoint at the end")
    if s == 0 and c == 0:
        raise ValueError("a checkpoint that costs nothing has no best interval: the shorter, the better")
    x = _root(lam * s) if s > 0 else 0.0
    return min(max(x / lam, c), 1 / lam)


def _root(eps: float) -> float:
    """The x in (0, 1) with (1 - x) e^x = e^(-eps), by bisection: below Young's sqrt(2 eps), above 0."""
    lo, hi = 0.0, min(1.0, math.sqrt(2 * eps))
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid < 1 and math.log1p(-mid) + mid + eps > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-16 * hi:
            break
    return (lo + hi) / 2


def longest_recovery(cluster: Cluster, job: Job, target: float) -> float:
    """The longest restart + reload (seconds) for which goodput stays at least ``target``, or -1
    when even an instant recovery does not reach it (goodput falls as e^(-lam b) with the recovery b)."""
    instant = goodput(cluster, Job(job.interval_s, job.save_s, 0.0, 0.0, job.asynchronous, job.stall_s))
    if instant < target:
        return -1.0
    lam = failure_rate(cluster)
    return math.inf if lam == 0 else math.log(instant / target) / lam


# --- the simulation -------------------------------------------------------------------------------------

Z_999 = 3.2905  # two-sided 99.9 % of a normal distribution


@dataclass(frozen=True)
class Simulated:
    goodput: float      # committed work / wall time over every simulated cycle
    low: float          # the two-sided 99.9 % confidence interval (Z_999) of the long-run goodput
    high: float
    failures: int       # cycles simulated: one failure each
    wall_s: float
    work_s: float


def simulate(cluster: Cluster, job: Job, failures: int, seed: int | str) -> Simulated:
    """Play ``failures`` failures of the job out, one after the other, with a seeded generator.

    The moments just after a failure are alike (everything since the last checkpoint that counts is
    lost, the recovery begins), so the stretches between failures are independent cycles: each lasts
    an exponential time T (the failures' clock has no memory), and in it the job first recovers (b)
    and then commits a checkpoint whenever the timeline below reaches one before T. Goodput is the
    work of every cycle over their time; its confidence interval, the ratio's (the delta method).
    """
    validate(cluster, job)
    lam, tau, s, c, b = failure_rate(cluster), job.interval_s, stall(job), write(job), recovery(job)
    # The timeline after a recovery: train tau and stall s, then the first checkpoint counts once its
    # write (c) ends; from then on one more every s + max(tau, c) (a save waits for the previous write).
    first = b + tau + s + c
    period = s + max(tau, c)
    if lam == 0:
        value = tau / period
        return Simulated(value, value, value, 0, math.inf, math.inf)
    rng = random.Random(seed)
    sum_w = sum_t = sum_ww = sum_tt = sum_wt = 0.0
    for _ in range(failures):
        t = rng.expovariate(lam)
        w = 0.0 if t < first else tau * (1 + math.floor((t - first) / period))
        sum_w += w
        sum_t += t
        sum_ww += w * w
        sum_tt += t * t
        sum_wt += w * t
    ratio = sum_w / sum_t
    spread = max(0.0, (sum_ww - 2 * ratio * sum_wt + ratio * ratio * sum_tt) / failures)  # E[(W - ratio T)^2]
    half = Z_999 * math.sqrt(spread / failures) / (sum_t / failures)
    return Simulated(ratio, ratio - half, ratio + half, failures, sum_t, sum_w)


def simulate_days(cluster: Cluster, job: Job, days: float, seed: int | str) -> tuple[int, float]:
    """One run of ``days`` days: how many times it failed, and its effective training time."""
    validate(cluster, job)
    lam, tau, s, c, b = failure_rate(cluster), job.interval_s, stall(job), write(job), recovery(job)
    first, period, horizon = b + tau + s + c, s + max(tau, c), days * DAY_S
    rng = random.Random(seed)
    elapsed = work = 0.0
    count = 0
    while True:
        t = rng.expovariate(lam) if lam > 0 else math.inf
        if elapsed + t >= horizon:  # the run ends before this failure: what it committed by then
            left = horizon - elapsed
            work += 0.0 if left < first else tau * (1 + math.floor((left - first) / period))
            return count, work / horizon
        work += 0.0 if t < first else tau * (1 + math.floor((t - first) / period))
        elapsed += t
        count += 1


# --- Llama 3 405B ("The Llama 3 Herd of Models", https://ar5iv.labs.arxiv.org/html/2407.21783) -------------

# Section 3.3.4 and Table 5: 466 job interruptions in a 54-day snapshot of pre-training (47 planned,
# 419 unexpected), "higher than 90% effective training time"; section 3.3.1: up to 16K H100s, 16,384 in
# Table 4; Tectonic sustains 2 TB/s of checkpoint writes (7 TB/s at peak), each GPU's checkpoint 1 MB to
# 4 GB. The kit assumes the whole snapshot ran on 16,384 GPUs (the paper gives no GPU count per day).
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_INTERRUPTIONS = 466
LLAMA3_UNEXPECTED = 419
LLAMA3_EFFECTIVE = 0.90
LLAMA3_PARAMETERS = 405e9
LLAMA3_STORAGE_BYTES_PER_S = 2e12
# What a save writes, assumed (the paper gives no figure): Adam's float32 master weights, momentum and
# variance, 12 bytes a parameter, at the storage's sustained rate: 2.4 s, each GPU writing 297 MB. This is
# a lower bound: every byte over the storage's whole bandwidth, as if no writer waited on another. A save
# ends when its slowest writer does; with per-GPU checkpoints of up to 4 GB (the paper's figure) sharing
# the 2 TB/s, the largest writer takes 16,384 x its bytes / 2 TB/s (LLAMA3_WRITERS).
LLAMA3_SAVE_S = 12 * LLAMA3_PARAMETERS / LLAMA3_STORAGE_BYTES_PER_S
LLAMA3_WRITERS = (1e9, 4e9)  # bytes of the largest per-GPU checkpoint: the range LLAMA3_RANGE goes over


def llama3_cluster(interruptions: int = LLAMA3_INTERRUPTIONS) -> Cluster:
    """16,384 GPUs failing at the rate that gave ``interruptions`` interruptions in 54 days."""
    return Cluster(LLAMA3_GPUS, interruptions / (LLAMA3_GPUS * LLAMA3_DAYS * DAY_S))


def llama3_job(restart_s: float = 600.0, reload_s: float = 0.0, save_s: float = LLAMA3_SAVE_S) -> Job:
    """A blocking save of ``save_s`` at the best interval (which does not depend on the recovery)."""
    probe = Job(3600.0, save_s, restart_s, reload_s)
    return Job(best_checkpoint_interval(llama3_cluster(), probe), save_s, restart_s, reload_s)


def writer_save_s(bytes_per_gpu: float) -> float:
    """The stall of a save whose largest per-GPU checkpoint is ``bytes_per_gpu``: every GPU's share of the
    storage's bandwidth is 1/16,384 of it, so that writer ends last."""
    return LLAMA3_GPUS * bytes_per_gpu / LLAMA3_STORAGE_BYTES_PER_S


@dataclass(frozen=True)
class Budget:
    save: str           # what the save time is
    save_s: float
    interval_s: float   # the best checkpoint interval for it
    goodput: float      # with an instant recovery
    recovery_s: float   # the longest restart + reload for which the paper's 90 % holds


def llama3_range() -> list[Budget]:
    """The longest recovery that keeps Llama 3's 90 % over the save times the paper allows: the lower bound
    (LLAMA3_SAVE_S) and a largest per-GPU checkpoint of each size of LLAMA3_WRITERS."""
    cluster = llama3_cluster()
    saves = [("12 bytes a parameter over the whole 2 TB/s (a lower bound)", LLAMA3_SAVE_S)]
    saves += [(f"a largest per-GPU checkpoint of {size / 1e9:g} GB", writer_save_s(size)) for size in LLAMA3_WRITERS]
    out = []
    for what, save in saves:
        job = llama3_job(restart_s=0.0, save_s=save)
        out.append(Budget(what, save, job.interval_s, goodput(cluster, job),
                          longest_recovery(cluster, job, LLAMA3_EFFECTIVE)))
    return out
