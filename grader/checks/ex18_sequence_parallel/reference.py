"""Exercise 18, grader side: the dense block in one process, on the same weights and inputs, and what each
rank's share of it is."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from grader.rank.drivers.ex18_sequence_parallel import (BATCH, D_MODEL, REPLICATED, SPLIT, SavedTensors, build,
                                                       hidden_block, sizes)


def dense(data: dict, blocks: tuple[slice, ...] = ()) -> dict:
    """The dense block on the whole sequence: output, x's gradient, every parameter's value and gradient,
    and its intermediates. ``blocks``: keep only those hidden features (a rank's own term of the sum)."""
    norm, fc1, fc2 = data["norm"], data["fc1"], data["fc2"]
    params = {"norm.weight": norm.weight, "norm.bias": norm.bias, "fc1.weight": fc1.weight, "fc1.bias": fc1.bias,
              "fc2.weight": fc2.weight, "fc2.bias": fc2.bias}
    for p in params.values():
        p.grad = None
    x = data["x"].clone().requires_grad_(True)
    saved = SavedTensors(list(params.values()))
    with saved.hooks():
        normed = norm(x)
        w1, b1, w2 = fc1.weight, fc1.bias, fc2.weight
        if blocks:
            w1, b1, w2 = w1[blocks[0]], b1[blocks[0]], w2[:, blocks[0]]
        hidden = F.linear(normed, w1, b1)
        activated = F.gelu(hidden)
        out = x + F.linear(activated, w2, fc2.bias)
    (out * data["g"]).sum().backward()
    return {"output": out.detach(), "x_grad": x.grad.detach(), "saved": saved.record(), "x": data["x"],
            "values": {name: p.detach().clone() for name, p in params.items()},
            "grads": {name: p.grad.detach().clone() for name, p in params.items()},
            "normed": normed.detach(), "hidden": hidden.detach(), "activated": activated.detach()}


@functools.cache
def reference(scenario: str, world_size: int, salt: int = 0, block: tuple[int, int] | None = None,
              eps: float | None = None) -> dict:
    """The dense block of a scenario split over ``world_size`` ranks (its sizes: ``sizes``), computed once;
    ``block``: only those hidden features; ``eps``: the norm's eps replaced by this one."""
    seq, hidden = sizes(world_size)
    data = build(scenario, seq, hidden, salt=salt)
    if eps is not None:
        data["norm"].eps = eps
    return dense(data, (slice(*block),) if block else ())


def expected_main(world_size: int) -> dict:
    return reference("main", world_size)


def own_term(rank: int, world_size: int) -> dict:
    block = hidden_block(rank, world_size, sizes(world_size)[1])
    return reference("main", world_size, block=(block.start, block.stop))


def seq_of(want: dict) -> int:
    return want["x"].shape[0]


def hidden_of(want: dict) -> int:
    return want["values"]["fc1.weight"].shape[0]


def share_of(want: dict, name: str, rank: int, world_size: int, key: str = "values") -> torch.Tensor:
    """Rank ``rank``'s share of a dense parameter (its value or gradient): its block, or the whole."""
    tensor = want[key][name]
    if name in REPLICATED:
        return tensor
    hidden = hidden_of(want)
    return tensor.narrow(SPLIT[name], hidden_block(rank, world_size, hidden).start, hidden // world_size)


# --- memory -------------------------------------------------------------------------------------


def _sorted_values(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().reshape(-1).sort().values


def classify_saved(saved: list[dict], hidden_width: int, whole: int, parameters: list[torch.Tensor]) -> list[dict]:
    """Each saved storage with "kind" and "elements" (its bytes / 8), told apart by the shapes autograd saved it
    in, never by its values (a wrong GELU or eps changes the values, not where a tensor lies):

    * "inside": a view's last dimension is ``hidden_width``: this rank's hidden block (fc1's output, GELU's, fc2's
      input), which lies in the parallel region whatever its values;
    * "gathered": fc1's input, the whole sequence at the model's width (``whole`` elements): the last such storage
      saved, as fc1 runs after the norm;
    * "parameter": a copy of one of ``parameters``' values (exactly: they are the grader's, copied);
    * "outside": the rest: the norm's input and statistics, the residual's.
    """
    param_sorted = [_sorted_values(t) for t in parameters]
    out = []
    for entry in saved:
        kind = "outside"
        if any(v["shape"] and v["shape"][-1] == hidden_width for v in entry["views"]):
            kind = "inside"
        else:
            for view in entry["views"]:
                values = view["values"]
                if isinstance(values, torch.Tensor) and any(
                        _sorted_values(values).shape == ref.shape and torch.equal(_sorted_values(values), ref)
                        for ref in param_sorted):
                    kind = "parameter"
        out.append({**entry, "kind": kind, "elements": entry["bytes"] // 8})
    gathered = [e for e in out if e["kind"] == "outside" and e["elements"] == whole]
    if gathered:
        gathered[-1]["kind"] = "gathered"
    return out


def inside_tensors(want: dict, rank: int, world_size: int) -> list[torch.Tensor]:
    """What a rank saves inside the parallel region: fc1's whole input, its hidden block before and after GELU."""
    block = hidden_block(rank, world_size, hidden_of(want))
    return [want["normed"], want["hidden"][..., block], want["activated"][..., block]]


def whole_of(want: dict) -> int:
    """Elements of one activation of the whole sequence at the model's width: seq x batch x d."""
    return seq_of(want) * BATCH * D_MODEL


def outside_bytes_dense(want: dict) -> int:
    entries = classify_saved(want["saved"], hidden_of(want), whole_of(want), list(want["values"].values()))
    return sum(e["bytes"] for e in entries if e["kind"] == "outside")
