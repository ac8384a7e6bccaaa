"""Exercise 22: "Expected to have finished reduction in the prior iteration" (a loss that leaves
the auxiliary head out during the warm-up).

Rank side: run the script's main() under torchrun's variables (see debug_job.run_job); the
probes record how each DistributedDataParallel was built. Grader side: the job must end on
every rank, DDP must run with its defaults (no find_unused_parameters, no static_graph), and
the ranks' models must be identical and equal to the grader's replay: the main loss alone in
the warm-up epoch, then the main loss plus AUX_WEIGHT times the auxiliary loss.
"""

from __future__ import annotations

import torch.nn.functional as F

from grader.checks.shared import debug_job
from grader.checks.interface import Grader
from grader.rank.drivers.shared.stub_models import TwoHeadNet
from grader.rank.drivers.ex22_unused_params import EPOCHS, make_data, rank_main


LR = 0.1
AUX_WEIGHT = 0.3
WARMUP_EPOCHS = 1
OTHER_CHECKS = ("ddp-defaults", "params-identical", "matches-replay")


def grade(g: Grader) -> None:
    data = make_data()
    others = [c for c in OTHER_CHECKS if c != "ddp-defaults"]
    for job in debug_job.finished_jobs(g, rank_main, data, others, before=check_defaults):
        debug_job.check_params_identical(g, job)
        check_training(g, job, data)


def check_defaults(g, job: debug_job.Job) -> None:
    """find_unused_parameters and static_graph stay off: the report asks for the cause."""
    for rank, record in enumerate(job.records):
        if record is None:
            continue
        for settings in record["ddp"]:
            turned_on = [name for name in ("find_unused_parameters", "static_graph") if settings.get(name)]
            if turned_on:
                g.record("ddp-defaults", False, f"rank {rank} built DistributedDataParallel with "
                         f"{' and '.join(f'{name}=True' for name in turned_on)}, which the bug report rules out: the "
                         "parameters that get no gradient are still there", rank=rank, world_size=job.world_size)
                return
    g.record("ddp-defaults", True)


def check_training(g, job: debug_job.Job, data: dict) -> None:
    steps, _ = debug_job.steps_of(job.records[0], job.index_of)
    epoch_of_step = [e for e, epoch in enumerate(debug_job.epochs_of(steps, EPOCHS)) for _ in epoch]

    def loss_with(warmup_weight):
        def loss_fn(model, x, y, step):
            logits, aux_logits = model(x)
            in_warmup = step >= len(epoch_of_step) or epoch_of_step[step] < WARMUP_EPOCHS
            weight = warmup_weight if in_warmup else AUX_WEIGHT
            return F.cross_entropy(logits, y) + weight * F.cross_entropy(aux_logits, y)
        return loss_fn

    def explain(per_rank, start, final) -> str:
        """Is it the schedule of the auxiliary loss? Name the one the ranks followed."""
        for warmup_weight, words in ((AUX_WEIGHT, "the auxiliary loss from the first epoch on (no warm-up)"),):
            model = TwoHeadNet()
            model.load_state_dict(start)
            debug_job.replay(model, per_rank, data["train_x"], data["train_y"], lr=LR,
                             loss_fn=loss_with(warmup_weight))
            if debug_job.same_state(final, debug_job.cpu_state(model)):
                return (f"it matches training with {words}: epoch 0 trains the main loss alone, later epochs "
                        f"add {AUX_WEIGHT} x the auxiliary loss")
        return ""

    debug_job.check_replay(g, job, TwoHeadNet(), data["train_x"], data["train_y"], lr=LR, loss_fn=loss_with(0.0),
                           explain=explain)
