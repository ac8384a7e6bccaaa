"""Demonstrations for the quiz topic 'resilience' (grader/quiz/bank/resilience.toml).

Each answer is computed from the kit's own model of a job that fails and restarts, ``grader.resilience``
(the model exercise 44 states, held there to a seeded simulation): Llama 3 405B's interruption rate, the
job's and one GPU's MTBF, Young's interval and the exact one, asynchronous saves, recoveries that fail.
Each test asserts that the keyed choice is what the model gives and that every distractor's figure is not.
Pure Python: no torch, no process group.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from grader import resilience as rs

HOUR, MINUTE = 3600.0, 60.0
LLAMA3 = rs.llama3_cluster()


def keyed(value: float, right: float, wrong: list[float], digits: int = 1) -> None:
    """``value`` is the keyed choice to its ``digits`` and lies nearer to it than to any distractor."""
    assert abs(value - right) <= 0.5 * 10**-digits + 1e-9, (value, right)
    assert all(abs(value - right) < abs(value - w) for w in wrong), (value, wrong)


def mtbf(cluster: rs.Cluster) -> float:
    return 1 / rs.failure_rate(cluster)


def test_llama3_was_interrupted_every_2_8_hours_and_each_gpu_fails_every_5_years():
    job_h = mtbf(LLAMA3) / HOUR
    gpu_years = 1 / LLAMA3.gpu_failure_rate / rs.YEAR_S
    keyed(job_h, 2.8, [3.1])
    keyed(gpu_years, 5.2, [job_h / (365.25 * 24), 7.8 / 12, 5.8])
    server_months = mtbf(LLAMA3) * (LLAMA3.gpus // 8) / (rs.YEAR_S / 12)  # a server of 8 GPUs, not a GPU
    keyed(server_months, 7.8, [gpu_years * 12])
    unexpected = rs.llama3_cluster(rs.LLAMA3_UNEXPECTED)  # only the 419 unexpected interruptions
    keyed(mtbf(unexpected) / HOUR, 3.1, [2.8])
    keyed(1 / unexpected.gpu_failure_rate / rs.YEAR_S, 5.8, [5.2])
    keyed(mtbf(unexpected) * (LLAMA3.gpus // 8) / (rs.YEAR_S / 12), 8.7, [7.8])  # and a server's, from those
    assert mtbf(LLAMA3) / LLAMA3.gpus < 1.0  # a GPU failing every 2.8 hours: the job stopped every 0.6 s


def test_100000_gpus_fail_every_27_minutes_and_checkpoint_2_5_times_as_often():
    big = rs.Cluster(100_000, LLAMA3.gpu_failure_rate)
    keyed(mtbf(big) / MINUTE, 27, [2.8 * 60, 17 * 60], digits=0)
    job = rs.Job(3600.0, rs.LLAMA3_SAVE_S, 600.0, 0.0)
    shrink = rs.young_daly_interval(LLAMA3, job) / rs.young_daly_interval(big, job)
    keyed(shrink, 2.5, [100_000 / 16_384, 1 / 2.5, 16_384 / 100_000])  # not 6.1 times, nor longer
    keyed(mtbf(LLAMA3) * 100_000 / 16_384 / HOUR, 17, [27 / 60, 2.8], digits=0)  # the growth multiplied in


def test_llama3_checkpoints_every_3_7_minutes_for_2_2_percent():
    save, m = rs.LLAMA3_SAVE_S, mtbf(LLAMA3)
    assert save == 12 * 405e9 / 2e12  # Adam's float32 states at the storage's sustained 2 TB/s
    job = rs.Job(3600.0, save, 0.0, 0.0)
    young = rs.young_daly_interval(LLAMA3, job)

    def cost(tau: float, mtbf_s: float = m) -> float:  # first order: saves plus half an interval per failure
        return save / tau + tau / (2 * mtbf_s)

    keyed(young / MINUTE, 3.7, [math.sqrt(save * m) / MINUTE, 7.8 * 60, 1.4 * 60])
    keyed(100 * cost(young), 2.2, [2.3, 0.02, 25], digits=1)
    keyed(math.sqrt(save * m) / MINUTE, 2.6, [3.7])                                 # without the 2
    keyed(100 * cost(math.sqrt(save * m)), 2.3, [2.2])
    per_gpu = math.sqrt(2 * save / LLAMA3.gpu_failure_rate)                          # one GPU's MTBF
    keyed(per_gpu / HOUR, 7.8, [3.7 / 60])
    keyed(100 * cost(per_gpu, 1 / LLAMA3.gpu_failure_rate), 0.02, [2.2], digits=2)
    keyed(m / 2 / HOUR, 1.4, [3.7 / 60])                                             # half the MTBF
    keyed(100 * cost(m / 2), 25, [2.2], digits=0)
    best = rs.best_checkpoint_interval(LLAMA3, job)
    assert best < young and abs(young / best - 1 - 0.007) < 0.001                   # 0.7 % shorter
    assert rs.goodput(LLAMA3, replace(job, interval_s=young)) < rs.goodput(LLAMA3, replace(job, interval_s=best))


def test_the_exact_interval_is_16_percent_shorter_than_youngs_for_a_long_save():
    cluster = rs.Cluster(100_000, 1 / (3 * rs.YEAR_S))
    job = rs.Job(3600.0, 120.0, 600.0, 300.0)
    keyed(mtbf(cluster) / MINUTE, 16, [27], digits=0)
    young, best = rs.young_daly_interval(cluster, job), rs.best_checkpoint_interval(cluster, job)
    keyed(young, 477, [400], digits=0)
    keyed(best, 400, [477, 560, 120], digits=-1)
    keyed(100 * (1 - best / young), 16, [-17, 0], digits=0)
    keyed(100 * (young / best - 1), 19, [0], digits=0)

    def goodput(tau: float) -> float:
        return rs.goodput(cluster, replace(job, interval_s=tau))

    assert goodput(best) > max(goodput(young), goodput(1.17 * young), goodput(job.save_s))
    assert all(goodput(best) >= goodput(best * f) for f in (0.99, 0.999, 1.001, 1.01))
    m, s = mtbf(cluster), job.save_s  # Daly's higher-order estimate, his equation 37
    daly = math.sqrt(2 * s * m) * (1 + math.sqrt(s / (2 * m)) / 3 + s / (18 * m)) - s
    keyed(daly, 400.0, [best + 0.2], digits=1)
    assert goodput(s) < s / (s + s) == 0.5  # an interval as long as the save: half the time saving, less with failures


def test_an_asynchronous_save_loses_its_write_to_a_failure():
    asynchronous = rs.Job(120.0, 60.0, 600.0, 60.0, asynchronous=True, stall_s=0.8)
    stall_only = rs.Job(120.0, 0.8, 600.0, 60.0)            # a blocking save as short as the stall
    blocking = rs.Job(120.0, 60.0, 600.0, 60.0)             # a blocking save of the whole write
    keyed(100 * rs.goodput(LLAMA3, asynchronous), 91.9, [92.4, 61.9])
    keyed(100 * rs.goodput(LLAMA3, stall_only), 92.4, [91.9])
    keyed(100 * rs.goodput(LLAMA3, blocking), 61.9, [91.9])
    # What a failure costs beyond the stall: the write in flight, e^(lam x write), and no less.
    ratio = rs.goodput(LLAMA3, stall_only) / rs.goodput(LLAMA3, asynchronous)
    assert abs(ratio - math.exp(rs.failure_rate(LLAMA3) * asynchronous.save_s)) < 1e-12
    # A save waits for the previous write: an interval shorter than the write commits no more often.
    short = replace(asynchronous, interval_s=30.0)
    sim = rs.simulate(LLAMA3, short, 100_000, seed="async-wait")
    assert sim.low <= rs.goodput(LLAMA3, short) <= sim.high
    assert rs.goodput(LLAMA3, short) < rs.goodput(LLAMA3, asynchronous)


def test_a_20_minute_recovery_takes_29_minutes_when_failures_restart_it():
    cluster = rs.Cluster(100_000, LLAMA3.gpu_failure_rate)
    lam, b = rs.failure_rate(cluster), 20 * MINUTE
    keyed(mtbf(cluster) / MINUTE, 27, [20], digits=0)
    mean = math.expm1(lam * b) / lam
    keyed(mean / MINUTE, 29, [20, 47, 35], digits=0)
    keyed((b + mtbf(cluster)) / MINUTE, 47, [29], digits=0)
    keyed(b * (1 + lam * b) / MINUTE, 35, [29], digits=0)
    # The same mean, played out: 100,000 recoveries, each tried until b seconds pass without a failure.
    rng = random.Random(6)
    total = 0.0
    for _ in range(100_000):
        while (t := rng.expovariate(lam)) < b:
            total += t
        total += b
    assert abs(total / 100_000 - mean) < 0.02 * mean  # the standard error is about 0.3 %
    llama = rs.failure_rate(LLAMA3)
    keyed(math.expm1(llama * b) / llama / MINUTE, 21, [20, 29], digits=0)


def test_llama3_keeps_90_percent_with_recoveries_up_to_14_minutes():
    job = rs.llama3_job(restart_s=0.0)
    keyed(100 * rs.goodput(LLAMA3, job), 97.8, [90.0])
    longest = rs.longest_recovery(LLAMA3, job, rs.LLAMA3_EFFECTIVE)
    keyed(longest / MINUTE, 14, [17, 4, 83], digits=0)
    assert rs.goodput(LLAMA3, replace(job, restart_s=longest - 1)) > 0.90 > rs.goodput(
        LLAMA3, replace(job, restart_s=longest + 1))
    keyed(0.1 * mtbf(LLAMA3) / MINUTE, 17, [14], digits=0)         # 10 % of the MTBF: no room for saves
    keyed(job.interval_s / MINUTE, 4, [14], digits=0)               # the checkpoint interval
    keyed(mtbf(LLAMA3) / 2 / MINUTE, 83, [14], digits=0)            # half the MTBF
    count, effective = rs.simulate_days(LLAMA3, replace(job, restart_s=longest - 60), rs.LLAMA3_DAYS, seed="90")
    assert abs(count - rs.LLAMA3_INTERRUPTIONS) < 4 * math.sqrt(rs.LLAMA3_INTERRUPTIONS) and effective > 0.895
