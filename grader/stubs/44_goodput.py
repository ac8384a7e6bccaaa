"""Exercise 44: napkin math, part 4: goodput at scale.

    goodput(cluster: Cluster, job: Job) -> float
    best_checkpoint_interval(cluster: Cluster, job: Job) -> float

"Llama 3 405B trained on 16,384 GPUs and was interrupted 466 times in 54 days. How often
should it checkpoint, and how much of its time did it spend training?" Answer with two
functions: the fraction of wall time spent on work a checkpoint keeps, and the checkpoint
interval that makes it largest. Every time is in seconds.

The model (the grader's simulation plays out exactly this):
  - Each GPU fails at random, independently, at gpu_failure_rate failures a second: the
    time to its next failure is exponential, whatever it has run so far. Training is
    synchronous, so the job stops when any one of its gpus GPUs fails. A failed GPU is
    replaced at once, and a failure can strike at any moment: while training, saving,
    restarting or reloading.
  - The job trains interval_s seconds, then checkpoints.
    Blocking (asynchronous=False): training stops for save_s while the checkpoint is
    written; the checkpoint counts (can be reloaded) once written.
    Asynchronous (asynchronous=True), as torch.distributed.checkpoint.async_save and
    torchtitan save: training stops for stall_s while the state is copied to host memory,
    then goes on while the copy is written to storage for save_s. The checkpoint counts once
    written (DCP writes its .metadata last, and torchtitan loads only a checkpoint that has
    one): a failure before then loses it, and the job goes back to the checkpoint before. A
    save starts only once the previous one is written; until then training waits (torchtitan
    waits for the previous save before it stages the next).
  - After a failure the job restarts (restart_s: the failure noticed, the node replaced, the
    processes and their process groups started), then reloads the last checkpoint that
    counts (reload_s). A failure during either starts both over. The work done since that
    checkpoint is lost.
  - goodput is the long-run fraction of wall time spent on work that ends up in a checkpoint
    that counts, as the job runs on and on: the Llama 3 paper's "effective training time",
    the time spent on useful training over the elapsed time.
  - best_checkpoint_interval returns the interval_s that maximises goodput, every other
    field as given (job.interval_s itself is not read). First order, Young's formula:
    sqrt(2 x save x MTBF), with MTBF = 1 / (gpus x gpu_failure_rate) and save what a
    checkpoint stops training for (save_s, or stall_s when asynchronous). Then exactly.
  - Raise ValueError for a job that cannot exist: gpus below 1, a negative rate or time, an
    interval_s of 0. best_checkpoint_interval also raises it when no interval is best: a job
    that never fails (a rate of 0), or a checkpoint that costs nothing (nothing stops
    training and nothing is written).
  - Return a float: goodput a fraction between 0 and 1, not a percentage.

Grade it:  ddp-grade exercises/44_goodput.py
The grader simulates each job below with a fixed seed (400,000 failures played out one
after the other, in the grader) and wants your goodput inside the simulation's 99.9 %
confidence interval: jobs from 1,024 to 100,000 GPUs, blocking and asynchronous saves,
restarts as long as the time between failures, a write longer than the interval. It wants
your best interval within 1 % of Young's where a save is short next to the MTBF, and within
0.1 % of the exact maximiser in every job (Daly's higher-order estimate is 0.6 % off where a
save takes half the MTBF). Then Llama 3 405B ("The Llama 3 Herd of Models",
section 3.3.4 and its Table 5): 466 interruptions in a 54-day snapshot on 16,384 GPUs (47
planned, 419 unexpected: the model counts them all as failures), and more than 90 % effective
training time (the model assumes all 54 days ran on 16,384 GPUs). With free saves and
restarts and an hourly checkpoint, your goodput must imply those 466 interruptions; with a
2.4 s blocking save (12 bytes a parameter, Adam's float32 states, written at the 2 TB/s the
paper's storage sustains, section 3.3.1) at the best interval, it must keep the 90 % for
restarts up to the kit's figure (about 14 minutes) and lose it beyond. The 2.4 s is a lower
bound (every byte over the whole bandwidth; a save ends with its slowest writer): if the
largest GPU writes 1 GB of the 2 TB/s the figure is about 11 minutes, at 4 GB (the paper's
largest) about 4.
"""

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


def goodput(cluster: Cluster, job: Job) -> float:
    # TODO: the job's failure rate; the expected wall time from one checkpoint that counts to the
    # next, counting failures while training, saving, restarting and reloading; work over time.
    raise NotImplementedError


def best_checkpoint_interval(cluster: Cluster, job: Job) -> float:
    # TODO: Young's sqrt(2 x save x MTBF) first; then the interval where goodput stops growing.
    raise NotImplementedError
