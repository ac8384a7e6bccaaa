"""Exercise 44, right, another style: everything in hours inside (the inputs converted on the way in,
the interval back to seconds on the way out), goodput as one closed-form expression, and the best interval
from the Lambert W function: x = lam tau solves (1 - x) e^x = e^(-lam stall), so x = 1 + W0(-e^(-1 - lam stall)),
started from W0's series at its branch point and polished with Newton's method."""

import math
from dataclasses import dataclass

HOUR = 3600.0


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


def _hours(cluster: Cluster, job: Job):
    """(failures an hour, interval, stall, write, recovery in hours), after refusing impossible jobs."""
    numbers = {"gpus": cluster.gpus, "gpu_failure_rate": cluster.gpu_failure_rate, "save_s": job.save_s,
               "restart_s": job.restart_s, "reload_s": job.reload_s, "stall_s": job.stall_s}
    if cluster.gpus < 1:
        raise ValueError("gpus must be at least 1")
    negative = [name for name, value in numbers.items() if value < 0]
    if negative:
        raise ValueError(f"negative: {', '.join(negative)}")
    if not job.interval_s > 0:
        raise ValueError("interval_s must be positive")
    per_hour = cluster.gpus * cluster.gpu_failure_rate * HOUR
    if job.asynchronous:
        stall, write = job.stall_s / HOUR, job.save_s / HOUR
    else:
        stall, write = job.save_s / HOUR, 0.0
    return per_hour, job.interval_s / HOUR, stall, write, (job.restart_s + job.reload_s) / HOUR


def goodput(cluster: Cluster, job: Job) -> float:
    rate, tau, stall, write, recovery = _hours(cluster, job)
    cadence = stall + max(tau, write)
    if rate == 0.0:
        return tau / cadence
    # Renewal reward, simplified: the mean time between checkpoints that count is
    # e^(rate (recovery + tau + stall + write)) (1 - e^(-rate cadence)) / rate.
    return rate * tau * math.exp(-rate * (recovery + tau + stall + write)) / -math.expm1(-rate * cadence)


def _lambert_x(eps: float) -> float:
    """1 + W0(-e^(-1 - eps)) for eps > 0."""
    p = math.sqrt(2 * -math.expm1(-eps))        # W0 near -1/e: -1 + p - p^2/3 + 11 p^3 / 72 - ...
    x = min(p - p * p / 3 + 11 * p ** 3 / 72, 0.999)
    for _ in range(60):                         # Newton on log(1 - x) + x + eps = 0
        step = (math.log1p(-x) + x + eps) / (-x / (1 - x))
        x = min(max(x - step, x / 2), (1 + x) / 2)
        if abs(step) <= 1e-15 * x:
            break
    return x


def best_checkpoint_interval(cluster: Cluster, job: Job) -> float:
    rate, _, stall, write, _ = _hours(cluster, job)
    if rate == 0.0:
        raise ValueError("no failures: no best interval")
    if stall == 0.0 and write == 0.0:
        raise ValueError("free checkpoints: no best interval")
    tau = _lambert_x(rate * stall) / rate if stall > 0 else 0.0
    tau = min(max(tau, write), 1 / rate)
    return tau * HOUR
