"""Exercise 44 answered by the grader's own model: the stub's dataclasses, and goodput and
best_checkpoint_interval taken from grader.resilience (whose simulation the checks compare with). Plain, in
the learner's own kit, it finds them (docs/guarantees.md); in a sandbox, where nothing of the grader's side
exists, every call raises ImportError (cannot import name) and not one check passes."""


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


def _theirs(cluster: Cluster, job: Job):
    from dataclasses import asdict

    from grader import resilience

    return resilience, resilience.Cluster(**asdict(cluster)), resilience.Job(**asdict(job))


def goodput(cluster: Cluster, job: Job) -> float:
    model, c, j = _theirs(cluster, job)
    return model.goodput(c, j)


def best_checkpoint_interval(cluster: Cluster, job: Job) -> float:
    model, c, j = _theirs(cluster, job)
    return model.best_checkpoint_interval(c, j)
