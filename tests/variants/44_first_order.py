"""Exercise 44, wrong on purpose. Young's first-order model throughout: a checkpoint costs its stall, a failure half an interval plus
the write and the recovery, each failure counted once. Near enough where failures are rare next to the interval
(Llama 3's scale, 0.3 % off), off, even below zero, where they come every few intervals; its best interval is
Young's sqrt(2 x save x MTBF)."""
# expect-fail: goodput-simulated
# expect-fail: async-simulated
# expect-fail: best-interval-exact
# expect-fail: llama3-interruptions
# expect-fail: llama3-effective-time
# expect-pass: best-interval-first-order bad-inputs-refused


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


def check(cluster: Cluster, job: Job) -> None:
    if cluster.gpus < 1:
        raise ValueError(f"a job runs on at least 1 GPU, not {cluster.gpus}")
    if cluster.gpu_failure_rate < 0:
        raise ValueError(f"a failure rate cannot be negative: {cluster.gpu_failure_rate}")
    if job.interval_s <= 0:
        raise ValueError(f"the interval must be some training, not {job.interval_s} s")
    for name in ("save_s", "restart_s", "reload_s", "stall_s"):
        if getattr(job, name) < 0:
            raise ValueError(f"{name} cannot be negative: {getattr(job, name)}")


def costs(cluster: Cluster, job: Job) -> tuple[float, float, float, float]:
    """The job's failure rate, what a checkpoint stops training for, what it writes after training
    resumes, and a recovery."""
    lam = cluster.gpus * cluster.gpu_failure_rate  # N exponential clocks: the first rings at N times the rate
    stall = job.stall_s if job.asynchronous else job.save_s
    write = job.save_s if job.asynchronous else 0.0
    return lam, stall, write, job.restart_s + job.reload_s


def goodput(cluster: Cluster, job: Job) -> float:
    check(cluster, job)
    lam, stall, write, recover = costs(cluster, job)
    tau = job.interval_s

    # 1. Without failures a checkpoint counts every stall + max(tau, write) seconds: a save waits for
    #    the previous write, so an interval shorter than the write only waits.
    period = stall + max(tau, write)
    if lam == 0:
        return tau / period

    # 2. Per second of training: a stall every tau seconds, and lam failures a second, each losing half
    #    an interval on average, the write in flight and a recovery.
    return 1 - stall / tau - lam * (tau / 2 + write + recover)


def best_checkpoint_interval(cluster: Cluster, job: Job) -> float:
    check(cluster, job)
    lam, stall, write, _ = costs(cluster, job)
    if lam == 0:
        raise ValueError("a job that never fails has no best interval: checkpoint at the end")
    if stall == 0 and write == 0:
        raise ValueError("a checkpoint that costs nothing has no best interval: the more often, the better")

    # 1. First order (Young 1974): each checkpoint costs `stall`, each failure about half an interval;
    #    stall / tau + lam tau / 2 is least at tau = sqrt(2 stall / lam) = sqrt(2 x save x MTBF).
    young = math.sqrt(2 * stall / lam)

    tau = young

    # 3. No interval shorter than the write helps: the next save would wait for it. (Past a write
    #    longer than the MTBF, waiting beats working: 1 / lam is then best.)
    return min(max(tau, write), 1 / lam)
