"""Exercise 19, grader side: the same training on the global batch in one process, and each rank's block of
its result."""

from __future__ import annotations

import torch

from grader.rank.drivers.ex19_data_tensor_parallel import LR, STEPS, dense_layers, make_data


# --- the reference --------------------------------------------------------------------------------


def reference_run(rows: int | None = None) -> dict:
    """The dense MLP trained in one process with plain SGD on the whole batch (the mean squared error
    over every row): its state dict before each step ("before") and after the last ("final")."""
    import torch.nn.functional as F

    fc1, fc2 = dense_layers()
    inputs, targets = make_data() if rows is None else make_data(rows)
    params = {"fc1.weight": fc1.weight, "fc1.bias": fc1.bias, "fc2.weight": fc2.weight, "fc2.bias": fc2.bias}
    before = []
    for _ in range(STEPS):
        before.append({k: p.detach().clone() for k, p in params.items()})
        for p in params.values():
            p.grad = None
        out = fc2(F.gelu(fc1(inputs)))
        F.mse_loss(out, targets).backward()
        with torch.no_grad():
            for p in params.values():
                p -= LR * p.grad
    return {"before": before, "final": {k: p.detach().clone() for k, p in params.items()}}


def local_block(name: str, state: dict, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Parameter ``name`` of the stub's TensorParallelMLP on tensor-parallel rank ``tp_rank``, cut from the
    dense state dict ``state``: fc1's rows, fc2's columns, fc2's whole bias."""
    whole = state[name.replace("_", ".", 1)]
    if name == "fc2_bias":
        return whole
    dim = 1 if name == "fc2_weight" else 0
    return whole.chunk(tp_size, dim=dim)[tp_rank]
