"""Exercise 44: goodput and the best checkpoint interval, graded against a seeded simulation of
failures and against what the Llama 3 paper reports for 405B on 16,384 GPUs (worker side: the
learner's two functions on each job, built from the learner's own dataclasses, every answer sent back
as it came; grader side: each answer must be a finite float, then inside the 99.9 % confidence
interval of the grader's simulation of that job, the best interval within 1 % of Young's where a save
is short and within 0.1 % of the exact maximiser everywhere, the Llama 3 figures, the refusals). The
model, its exact formulas and the simulation: :mod:`grader.resilience`."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

from grader import resilience as rs
from grader.checks.interface import Grader
from grader.rank.drivers.ex44_goodput import serve_main


SEED = 44          # the simulation's; each job draws from its own stream, seeded with SEED and its name
FAILURES = 400_000  # failures played out per job
FIRST_ORDER_TOLERANCE = 0.01
EXACT_TOLERANCE = 0.001
RESTART_STEP_S = 5.0
RESTARTS = [RESTART_STEP_S * k for k in range(361)]  # 0 to 30 minutes
LLAMA3 = rs.llama3_cluster()
HOURLY_FREE = rs.Job(3600.0, 0.0, 0.0, 0.0)  # free saves and restarts: lost work alone
GPU_3Y, GPU_5Y = 1 / (3 * rs.YEAR_S), 1 / (5 * rs.YEAR_S)  # a GPU failing every 3 or 5 years
BLOCKING = {
    "Llama 3 405B: 16,384 GPUs, a 2.4 s save every 219 s, 10-minute restarts": (LLAMA3, rs.llama3_job()),
    "1,024 GPUs, a 60 s save every hour": (rs.Cluster(1024, GPU_5Y), rs.Job(3600.0, 60.0, 300.0, 60.0)),
    "100,000 GPUs (a failure every 16 minutes), a 2-minute save every 10 minutes": (
        rs.Cluster(100_000, GPU_3Y), rs.Job(600.0, 120.0, 600.0, 300.0)),
    "16,384 GPUs, a 10-minute save every 30 minutes": (rs.Cluster(16_384, GPU_5Y), rs.Job(1800.0, 600.0, 900.0, 300.0)),
    "32,768 GPUs (a failure every 48 minutes), 40-minute recoveries": (
        rs.Cluster(32_768, GPU_3Y), rs.Job(900.0, 60.0, 1800.0, 600.0)),
}
ASYNCHRONOUS = {
    "Llama 3 405B, asynchronous: a 0.8 s stall and a 60 s write every 2 minutes": (
        LLAMA3, rs.Job(120.0, 60.0, 600.0, 60.0, asynchronous=True, stall_s=0.8)),
    "100,000 GPUs, asynchronous: a 5 s stall and a 5-minute write every 10 minutes": (
        rs.Cluster(100_000, GPU_3Y), rs.Job(600.0, 300.0, 600.0, 300.0, asynchronous=True, stall_s=5.0)),
    "100,000 GPUs, asynchronous: a 400 s write every 200 s of training (saves wait)": (
        rs.Cluster(100_000, GPU_3Y), rs.Job(200.0, 400.0, 600.0, 300.0, asynchronous=True, stall_s=5.0)),
    "32,768 GPUs, asynchronous: a 2 s stall and a 10-minute write every 15 minutes": (
        rs.Cluster(32_768, GPU_3Y), rs.Job(900.0, 600.0, 600.0, 300.0, asynchronous=True, stall_s=2.0)),
}


# best_checkpoint_interval: where Young's formula is within 1 % (a save short next to the MTBF) ...
SHORT_SAVES = {
    "Llama 3 405B, a 2.4 s save": (LLAMA3, rs.llama3_job()),
    "512 GPUs, a 20 s save": (rs.Cluster(512, GPU_5Y), rs.Job(3600.0, 20.0, 300.0, 60.0)),
    "Llama 3 405B, asynchronous: a 1 s stall, a 60 s write": (
        LLAMA3, rs.Job(3600.0, 60.0, 600.0, 60.0, asynchronous=True, stall_s=1.0)),
}


# ... and where it is not (long saves; writes that bound the interval from below)
LONG_SAVES = {
    "100,000 GPUs, a 2-minute save": (rs.Cluster(100_000, GPU_3Y), rs.Job(3600.0, 120.0, 600.0, 300.0)),
    "16,384 GPUs, a 10-minute save": (rs.Cluster(16_384, GPU_5Y), rs.Job(3600.0, 600.0, 900.0, 300.0)),
    "100,000 GPUs, an 8-minute save (half the MTBF)": (rs.Cluster(100_000, GPU_3Y), rs.Job(3600.0, 480.0, 600.0, 300.0)),
    "100,000 GPUs, asynchronous: a 5 s stall, a 5-minute write": (
        rs.Cluster(100_000, GPU_3Y), rs.Job(3600.0, 300.0, 600.0, 300.0, asynchronous=True, stall_s=5.0)),
    "32,768 GPUs, asynchronous: a 30 s stall, a 2-minute write": (
        rs.Cluster(32_768, GPU_3Y), rs.Job(3600.0, 120.0, 600.0, 300.0, asynchronous=True, stall_s=30.0)),
}
JOB = rs.Job(3600.0, 60.0, 300.0, 60.0)
BAD_GOODPUT = {
    "0 GPUs": (rs.Cluster(0, GPU_5Y), JOB),
    "a negative failure rate": (rs.Cluster(1024, -GPU_5Y), JOB),
    "an interval of 0 s": (rs.Cluster(1024, GPU_5Y), replace(JOB, interval_s=0.0)),
    "a save of -60 s": (rs.Cluster(1024, GPU_5Y), replace(JOB, save_s=-60.0)),
    "a restart of -300 s": (rs.Cluster(1024, GPU_5Y), replace(JOB, restart_s=-300.0)),
}
BAD_INTERVAL = {
    "0 GPUs": (rs.Cluster(0, GPU_5Y), JOB),
    "a job that never fails (a rate of 0)": (rs.Cluster(1024, 0.0), JOB),
    "a blocking save of 0 s": (rs.Cluster(1024, GPU_5Y), replace(JOB, save_s=0.0)),
}


def case(cluster: rs.Cluster, job: rs.Job) -> dict:
    return {"cluster": asdict(cluster), "job": asdict(job)}


def grade(g: Grader) -> None:
    simulated_jobs = {**BLOCKING, **ASYNCHRONOUS}
    grid = [rs.llama3_job(restart_s=r) for r in RESTARTS]
    goodput_cases = ([case(*job) for job in simulated_jobs.values()] + [case(LLAMA3, HOURLY_FREE)]
                     + [case(LLAMA3, job) for job in grid] + [case(*job) for job in BAD_GOODPUT.values()])
    interval_jobs = {**SHORT_SAVES, **LONG_SAVES}
    interval_cases = [case(*job) for job in interval_jobs.values()] + [case(*job) for job in BAD_INTERVAL.values()]
    worker = g.worker(serve_main)
    try:
        goodputs = g.call(worker, "answers", function="goodput", cases=goodput_cases)
        intervals = g.call(worker, "answers", function="best_checkpoint_interval", cases=interval_cases)
    finally:
        worker.close()
    if len(goodputs) != len(goodput_cases) or len(intervals) != len(interval_cases):
        g.stop("the worker answered a different number of cases than it was asked")
    n = len(simulated_jobs)
    mine = dict(zip(simulated_jobs, goodputs[:n]))
    simulations = {name: simulated(name, *job) for name, job in simulated_jobs.items()}
    g.section("your goodput beside the grader's simulation", "\n".join(
        simulation_line(name, mine[name], simulations[name]) for name in simulated_jobs))
    check_simulated(g, "goodput-simulated", {k: (*BLOCKING[k], mine[k], simulations[k]) for k in BLOCKING})
    check_simulated(g, "async-simulated", {k: (*ASYNCHRONOUS[k], mine[k], simulations[k]) for k in ASYNCHRONOUS})
    interval_answers = dict(zip(interval_jobs, intervals[:len(interval_jobs)]))
    check_first_order(g, {k: (*SHORT_SAVES[k], interval_answers[k]) for k in SHORT_SAVES})
    check_exact(g, {k: (*interval_jobs[k], interval_answers[k]) for k in interval_jobs})
    check_llama3_interruptions(g, goodputs[n])
    check_llama3_effective_time(g, goodputs[n + 1:n + 1 + len(grid)])
    check_refusals(g, dict(zip(BAD_GOODPUT, goodputs[n + 1 + len(grid):])),
                   dict(zip(BAD_INTERVAL, intervals[len(interval_jobs):])))


# The simulations are the kit's own and the same every grading (seeded): a grading process runs each once.
_SIMULATED: dict = {}


def simulated(name: str, cluster: rs.Cluster, job: rs.Job) -> rs.Simulated:
    key = (name, cluster, job)
    if key not in _SIMULATED:
        _SIMULATED[key] = rs.simulate(cluster, job, FAILURES, seed=f"{SEED}:{name}")
    return _SIMULATED[key]


def number(answer: dict, function: str) -> tuple[float | None, str]:
    """The answer as a finite float, or None and what is wrong with it (naming the function)."""
    if "error" in answer:
        return None, f"{function} raised {answer['error']}"
    value = answer.get("value")
    if not isinstance(value, float):
        return None, f"{function} returned {answer.get('shown', repr(value))}, not a float"
    if math.isnan(value) or math.isinf(value):
        return None, f"{function} returned {value}, not a finite number"
    return value, ""


def simulation_line(name: str, answer: dict, sim: rs.Simulated) -> str:
    value, problem = number(answer, "goodput")
    yours = f"{value:.4f}" if value is not None else problem
    return (f"{name}:\n  yours {yours}; simulated {sim.goodput:.4f} over {sim.failures:,} failures "
            f"(99.9 % interval {sim.low:.4f} to {sim.high:.4f})")


def check_simulated(g: Grader, check_id: str, jobs: dict) -> None:
    """Each job's goodput inside the simulation's interval ({name: (cluster, job, answer, simulated)})."""
    for name, (cluster, job, answer, sim) in jobs.items():
        value, problem = number(answer, "goodput")
        if value is None:
            g.record(check_id, False, f"{name}: {problem}")
            return
        if not sim.low <= value <= sim.high:
            g.record(check_id, False,
                     f"{name}: your goodput {value:.4f} is outside the simulation's 99.9 % interval "
                     f"({sim.low:.4f} to {sim.high:.4f}, {sim.goodput:.4f} over {sim.failures:,} failures)"
                     + diagnosis(value, goodput_mistakes(cluster, job), sim))
            return
    g.record(check_id, True, f"inside the simulation's 99.9 % interval in all {len(jobs)} jobs")


def diagnosis(value: float, mistakes: dict, sim: rs.Simulated | None = None, exact: float | None = None) -> str:
    """": it equals ..." when ``value`` is one of ``mistakes`` (what -> its figure) and that figure is
    wrong (outside the interval, or 1e-3 off the exact value): never a candidate that is right."""
    for what, figure in mistakes.items():
        wrong = (not sim.low <= figure <= sim.high) if sim is not None else abs(figure - exact) > 1e-3 * abs(exact)
        if wrong and math.isfinite(figure) and abs(value - figure) <= 1e-6 * max(abs(figure), 1e-12):
            return f": it equals {what}"
    return ""


def _without_recovery_failures(lam: float, tau: float, s: float, c: float, b: float) -> float:
    """Goodput when a restart and a reload never fail: each failure costs b flat."""
    fails = -math.expm1(-lam * (s + max(tau, c)))
    through = math.expm1(lam * (tau + s + c)) * (1 / lam + b)
    return tau / (fails / lam + fails * (b + through))


def _without_save_failures(lam: float, tau: float, s: float, b: float) -> float:
    """Goodput of a blocking save that never fails: only training is exposed."""
    return tau / (math.exp(lam * b) * math.expm1(lam * tau) / lam + s)


def goodput_mistakes(cluster: rs.Cluster, job: rs.Job) -> dict:
    """What realistic wrong models give for this job (for the diagnosis only)."""
    lam, tau, s, c, b = rs.failure_rate(cluster), job.interval_s, rs.stall(job), rs.write(job), rs.recovery(job)
    found = {
        "the first-order estimate 1 - save / interval - (interval / 2 + write + recovery) / MTBF":
            rs.first_order_goodput(cluster, job),
        "the goodput of a job failing at one GPU's rate, not gpus times it": rs.goodput(replace(cluster, gpus=1), job),
        "the goodput with gpu_failure_rate read as failures an hour": rs.goodput(
            replace(cluster, gpu_failure_rate=cluster.gpu_failure_rate / 3600), job),
        "the goodput with no failure during a restart or reload": _without_recovery_failures(lam, tau, s, c, b),
        "the goodput as a percentage (100 times the fraction)": 100 * rs.goodput(cluster, job),
    }
    if job.asynchronous:
        found["the goodput of a checkpoint that counts as soon as it is copied (the write in flight never lost)"] = \
            rs.goodput(cluster, replace(job, save_s=0.0))
        found["the goodput of a blocking save of save_s"] = rs.goodput(cluster, replace(job, asynchronous=False))
        found["the goodput of saves that overlap (an interval shorter than the write does not wait)"] = \
            lam * tau * math.exp(-lam * (b + tau + s + c)) / -math.expm1(-lam * (s + tau))
    else:
        found["the goodput with no failure during a save"] = _without_save_failures(lam, tau, s, b)
    return found


def daly(save: float, mtbf: float) -> float:
    """Daly's higher-order estimate of the best interval (his equation 37, as LLNL's SCR computes it), the MTBF
    once the save takes 2 MTBFs or more."""
    if save >= 2 * mtbf:
        return mtbf
    f = save / (2 * mtbf)
    return math.sqrt(2 * save * mtbf) * (1 + math.sqrt(f) / 3 + f / 9) - save


def interval_mistakes(cluster: rs.Cluster, job: rs.Job) -> dict:
    lam, s, c = rs.failure_rate(cluster), rs.stall(job), rs.write(job)
    young = math.sqrt(2 * s / lam)
    found = {
        "Young's sqrt(2 x save x MTBF), the first-order interval": young,
        "Daly's higher-order estimate sqrt(2 save M) (1 + sqrt(save / 2M) / 3 + save / 18M) - save": daly(s, 1 / lam),
        "sqrt(save x MTBF), without the 2": math.sqrt(s / lam),
        "Young's interval with one GPU's MTBF, not the job's": math.sqrt(2 * s * cluster.gpus / lam),
        "the exact interval with gpu_failure_rate read as failures an hour": rs.best_checkpoint_interval(
            replace(cluster, gpu_failure_rate=cluster.gpu_failure_rate / 3600), job),
    }
    if job.asynchronous:
        found["the exact interval without the write's bound (saves overlapping)"] = rs._root(lam * s) / lam
        found["the best interval of a blocking save of save_s"] = rs.best_checkpoint_interval(
            cluster, replace(job, asynchronous=False))
        found["Young's interval with the write, sqrt(2 x save_s x MTBF)"] = math.sqrt(2 * c / lam)
    found["the exact interval of a job failing at one GPU's rate"] = rs.best_checkpoint_interval(
        replace(cluster, gpus=1), job)
    return found


def check_intervals(g: Grader, check_id: str, jobs: dict, expected, tolerance: float, against: str) -> None:
    for name, (cluster, job, answer) in jobs.items():
        value, problem = number(answer, "best_checkpoint_interval")
        if value is None:
            g.record(check_id, False, f"{name}: {problem}")
            return
        right = expected(cluster, job)
        if not abs(value - right) <= tolerance * right:
            there = rs.goodput(cluster, replace(job, interval_s=right))
            yours = f", goodput {rs.goodput(cluster, replace(job, interval_s=value)):.4f} there" if value > 0 else ""
            g.record(check_id, False,
                     f"{name} (MTBF {1 / rs.failure_rate(cluster) / 60:,.1f} minutes): your interval is {value:,.1f} s"
                     f"{yours}; {against} is {right:,.1f} s (goodput {there:.4f}), {(value - right) / right:+.1%}"
                     + diagnosis(value, interval_mistakes(cluster, job), exact=right))
            return
    g.record(check_id, True, f"within {tolerance:.1%} of {against} in all {len(jobs)} jobs")


def check_first_order(g: Grader, jobs: dict) -> None:
    check_intervals(g, "best-interval-first-order", jobs, rs.young_daly_interval, FIRST_ORDER_TOLERANCE,
                    "Young's sqrt(2 x save x MTBF)")


def check_exact(g: Grader, jobs: dict) -> None:
    check_intervals(g, "best-interval-exact", jobs, rs.best_checkpoint_interval, EXACT_TOLERANCE,
                    "the interval that maximises goodput")


def implied_interruptions(value: float, job: rs.Job) -> float:
    """Interruptions in 54 days that a goodput of ``value`` implies when only lost work costs: the x with
    x / (e^x - 1) = value, x = lam tau (0 for a goodput of 1 or more, inf for one of 0 or less)."""
    if value >= 1:
        return 0.0
    if value <= 0:
        return math.inf
    lo, hi = 0.0, 1.0
    while hi / math.expm1(hi) > value:
        hi *= 2
        if hi > 700:
            return math.inf
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid > 0 and mid / math.expm1(mid) > value:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2 / job.interval_s * rs.LLAMA3_DAYS * rs.DAY_S


def check_llama3_interruptions(g: Grader, answer: dict) -> None:
    value, problem = number(answer, "goodput")
    where = "Llama 3 405B (16,384 GPUs), free saves and restarts, an hourly checkpoint"
    if value is None:
        g.record("llama3-interruptions", False, f"{where}: {problem}")
        return
    implied = implied_interruptions(value, HOURLY_FREE)
    if not abs(implied - rs.LLAMA3_INTERRUPTIONS) <= 0.005 * rs.LLAMA3_INTERRUPTIONS:
        g.record("llama3-interruptions", False,
                 f"{where}: your goodput {value:.4f} implies {implied:,.1f} interruptions in 54 days (only lost work "
                 f"costs here, x / (e^x - 1) of the time with x = interval / MTBF); the paper reports 466 "
                 f"(section 3.3.4), one every {rs.LLAMA3_DAYS * 24 / rs.LLAMA3_INTERRUPTIONS:.1f} hours"
                 + diagnosis(value, goodput_mistakes(LLAMA3, HOURLY_FREE), exact=rs.goodput(LLAMA3, HOURLY_FREE)))
        return
    g.record("llama3-interruptions", True, f"your goodput implies {implied:.1f} interruptions in 54 days; the paper: 466")


def longest_restart(values: list[float]) -> float | None:
    """The last restart of the grid whose goodput is at least the paper's 90 % before the first below it
    (None when even the first is below)."""
    last = None
    for restart, value in zip(RESTARTS, values):
        if value < rs.LLAMA3_EFFECTIVE:
            break
        last = restart
    return last


def check_llama3_effective_time(g: Grader, answers: list) -> None:
    values = []
    for restart, answer in zip(RESTARTS, answers):
        value, problem = number(answer, "goodput")
        if value is None:
            g.record("llama3-effective-time", False, f"Llama 3 405B with a {restart:.0f} s restart: {problem}")
            return
        values.append(value)
    kit = longest_restart([rs.goodput(LLAMA3, rs.llama3_job(restart_s=r)) for r in RESTARTS])
    yours = longest_restart(values)
    interval = rs.llama3_job().interval_s
    count, effective = rs.simulate_days(LLAMA3, rs.llama3_job(), rs.LLAMA3_DAYS, seed=f"{SEED}:Llama 3, 54 days")
    g.section("Llama 3 405B", llama3_story(interval, count, effective))
    where = (f"Llama 3 405B: 466 interruptions in 54 days, a {rs.LLAMA3_SAVE_S:.1f} s save every {interval:.0f} s "
             f"(the best interval)")
    if yours is None:
        g.record("llama3-effective-time", False,
                 f"{where}: your goodput is {values[0]:.4f} even with an instant restart, below the paper's 90 %; "
                 f"the kit's stays at 90 % or more for restarts up to {kit / 60:.1f} minutes")
    elif abs(yours - kit) > RESTART_STEP_S:
        upto = ("for every restart tried, up to 30 minutes" if yours == RESTARTS[-1]
                else f"for restarts up to {yours / 60:.1f} minutes ({yours:.0f} s)")
        g.record("llama3-effective-time", False,
                 f"{where}: your goodput stays at 90 % or more {upto}; the kit's model, for restarts up to "
                 f"{kit / 60:.1f} minutes ({kit:.0f} s)")
    else:
        g.record("llama3-effective-time", True,
                 f"90 % or more for restarts up to {yours / 60:.1f} minutes with the {rs.LLAMA3_SAVE_S:.1f} s save "
                 f"(its lower bound), as the kit's model says")


def llama3_story(interval: float, count: int, effective: float) -> str:
    """What the model says of Llama 3's 54 days, over the save times the paper allows."""
    budgets = "; ".join(f"{b.save}: a {b.save_s:.1f} s save every {b.interval_s:.0f} s, up to "
                        f"{b.recovery_s / 60:.1f} minutes" for b in rs.llama3_range())
    return (f"466 interruptions in 54 days (section 3.3.4), the whole snapshot assumed to run on 16,384 GPUs: the "
            f"job's MTBF is {rs.LLAMA3_DAYS * 24 / rs.LLAMA3_INTERRUPTIONS:.2f} hours, one GPU's "
            f"{1 / LLAMA3.gpu_failure_rate / rs.YEAR_S:.1f} years. A {rs.LLAMA3_SAVE_S:.2f} s save every {interval:.0f} s "
            f"and 10-minute restarts, simulated for 54 days: {count} interruptions, {effective:.1%} effective training "
            f"time (the paper: above 90 %). How long a restart and reload may take for the 90 % to hold depends on "
            f"the save, which the paper does not give: {budgets}. The 2.4 s is total bytes over total bandwidth; "
            f"a save ends with its slowest writer.")


def check_refusals(g: Grader, goodputs: dict, intervals: dict) -> None:
    for function, answers in (("goodput", goodputs), ("best_checkpoint_interval", intervals)):
        for what, answer in answers.items():
            if not answer.get("value_error"):
                got = (f"raised {answer['error']}" if "error" in answer
                       else f"returned {answer.get('value', answer.get('shown'))!r}")
                g.record("bad-inputs-refused", False, f"{what}: {function} {got}, not ValueError")
                return
    g.record("bad-inputs-refused", True,
             f"ValueError for each of: {', '.join(goodputs)} (goodput); {', '.join(intervals)} (best_checkpoint_interval)")
