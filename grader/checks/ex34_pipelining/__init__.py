"""Exercise 34: build_pipeline and train_step with torch.distributed.pipelining (PipelineStage,
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B).

Rank side (rank.py): one run per world size W; for each schedule, what each rank holds after
build_pipeline (measured from the storages alive), which stages it built, and over three steps of
train_step every message, every forward and backward of each stage, the micro-batches' activations
alive at once, the loss and the parameters.

Grader side: the same model trained in one process on the same micro-batches, their gradients
accumulated (each micro-batch's mean loss divided by their number), SGD, compared with every rank's
parameters after each step; the rest decided from the records (verdicts.py).
"""

from __future__ import annotations

from grader import timeline
from grader.checks.ex34_pipelining import verdicts
from grader.rank.drivers.ex34_pipelining import SCHEDULES, rank_main
from grader.checks.ex34_pipelining.reference import reference_run
from grader.checks.interface import Grader
from grader.checks.shared import timelines


def grade(g: Grader) -> None:
    sizes = [w for w in g.world_sizes if w >= 2]
    if not sizes:
        g.stop("a pipeline of one stage has nothing to schedule: grade with --world-size 2 or more")
    runs = []
    for world_size in sizes:
        outcome = g.run(rank_main, world_size)
        timelines.keep(g, outcome, f"world size {world_size}", shown=world_size == sizes[-1], draw=("GPipe", "1F1B"))
        observations = outcome.results()
        for schedule in SCHEDULES:
            per_rank = [o.get(schedule) for o in observations]
            if any(obs is None for obs in per_rank):
                verdicts.not_run(g, schedule, world_size)
                continue
            verdicts.check_schedule(g, schedule, per_rank, world_size, reference_run(schedule, world_size))
            runs.append((schedule, world_size, per_rank))
    for schedule, world_size, per_rank in runs:
        if world_size == sizes[-1] and all(obs.get("steps") for obs in per_rank):
            order = [verdicts.labels(obs["steps"][-1]) for obs in per_rank]
            peaks = [obs["steps"][-1]["peak_live"] for obs in per_rank]
            view = timeline.slot_view(order, notes=[f"peak: {p} micro-batch{'' if p == 1 else 'es'}' activations"
                                                    for p in peaks],
                                      caption=f"world size {world_size}, the last step, each rank's actions in order")
            g.section(f"the {schedule} schedule as each rank ran it", verdicts.order_text(per_rank, world_size),
                      {"schedule": schedule, "world_size": world_size, "order": order, timeline.SLOT_KEY: view})
