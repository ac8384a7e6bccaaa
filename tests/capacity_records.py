"""What the tests of exercises 41-43's verdicts share: answers and rank 0's records as a faithful run of the
kit's model gives them (no processes started)."""

from __future__ import annotations

from grader import capacity
from grader.checks.shared import capacity_cases as cases


def answer(value) -> dict:
    """An answer as the worker reads it back from a learner's dataclass of 41-43 (their fields only)."""
    known = capacity.exercise_dict(value) if type(value).__name__ in capacity.EXERCISE_FIELDS else capacity.to_dict(value)
    return {"value": {k: (v if isinstance(v, (dict, str)) else float(v)) for k, v in known.items()}}


def record_for(name: str) -> dict:
    """Rank 0's record as a faithful run of the kit's model would measure it."""
    plan = cases.CONFIGS[name]
    memory = capacity.training_memory(cases.SMALL, plan)
    collectives = []
    for (dimension, op), (calls, size) in capacity.collectives(cases.SMALL, plan).items():
        collectives += [[dimension, op, size]] * calls
    return {"params_bytes": memory.params, "grads_bytes": memory.grads, "optimizer_bytes": memory.optimizer,
            "activations_bytes": memory.activations + layernorm_statistics(cases.SMALL, plan), "collectives": collectives,
            "flops": capacity.flops(cases.SMALL, plan)}


def layernorm_statistics(model: capacity.ModelSpec, plan: capacity.Plan) -> int:
    """What the real runs save beyond the formula: each LayerNorm's mean and rstd, one element a token each
    (tests/test_capacity_measured.py measures it)."""
    if plan.recompute == "full":
        return 0
    per_layer = 2 * 2 * capacity.element_bytes(plan) * plan.micro_batch * model.seq_len
    return model.layers // plan.pp * capacity.in_flight(plan) * per_layer


RECORDS = {name: [record_for(name)] for name in cases.CONFIGS}


def model_answers(function) -> dict:
    return {name: answer(function(cases.SMALL, plan)) for name, plan in cases.CONFIGS.items()}
