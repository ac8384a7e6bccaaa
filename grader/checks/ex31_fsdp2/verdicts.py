"""Exercise 31's verdicts, from the ranks' records (grader side): placements, units, dtypes on the wire,
clipping, training against the single-process replay, the returned loss and the full state dict.

A record is what the driver returned for one rank: ``params`` (each parameter as shard_model left
it), ``initial`` and each step's ``shards`` (the local values), each step's ``events`` (the probe's
collectives, all-gathers and reduce-scatters with their dtype, a ``forward-returned`` mark), each
step's ``loss``, ``error``, and ``state`` (the full state dict, on rank 0)."""

from __future__ import annotations

import math

import torch

from grader.rank import probes
from grader.checks.interface import Grader
from grader.checks.shared.learner_errors import checked_record, stop_on_learner_error
from grader.compare import tensor_difference

ALL_GATHERS, REDUCE_SCATTERS = probes.ALL_GATHERS, probes.REDUCE_SCATTERS
UPDATE_TOLERANCE = 0.03  # of the largest change of a parameter: bfloat16 compute, sums in another order
CLIP_TOLERANCE = 2e-3  # relative, on the norm of a step's update (float32 arithmetic)
LOSS_TOLERANCE = 0.02  # relative
AFTER_ERROR = ("block-units", "root-unit", "mixed-precision", "fp32-reduce", "global-clip", "returns-loss",
               "full-state-dict")


def _find(named: dict, key: str):
    """``named[key]``, or the entry whose name ends with ``.key`` (a wrapper's prefix still finds it)."""
    if key in named:
        return named[key]
    return next((v for k, v in named.items() if k.endswith("." + key)), None)


def _some(names: list[str], shown: int = 3) -> str:
    return ", ".join(repr(n) for n in names[:shown]) + (", ..." if len(names) > shown else "")


def _shard_dim(entry: dict | None) -> int | None:
    """The dim a parameter is sharded on (``Shard(dim=d)``), or None when it is not a 1-D sharded DTensor."""
    if not entry or not entry.get("dtensor") or len(entry.get("placements", [])) != 1:
        return None
    text = entry["placements"][0]
    if not text.startswith("Shard(dim="):
        return None
    return int(text[len("Shard(dim="):].rstrip(")"))


def local_part(full: torch.Tensor, entry: dict | None, rank: int, world_size: int) -> torch.Tensor:
    """What rank ``rank`` should hold of ``full``: its torch.chunk along the shard dim, or all of it."""
    dim = _shard_dim(entry)
    if dim is None:
        return full
    chunks = torch.chunk(full, world_size, dim=dim)
    if rank < len(chunks):
        return chunks[rank]
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_empty(shape)


def assemble(observations: list[dict], values_of, name: str) -> torch.Tensor | None:
    """A parameter whole again from every rank's local values (``values_of(obs)``), by its placements."""
    entry = _find({p["name"]: p for p in observations[0]["params"]}, name)
    parts = [_find(values_of(obs), name) for obs in observations]
    if any(p is None for p in parts):
        return None
    dim = _shard_dim(entry)
    return parts[0] if dim is None else torch.cat(parts, dim=dim)


# --- what shard_model left ----------------------------------------------------------------------


def check_placements(g: Grader, observations: list[dict], world_size: int, model) -> None:
    """``model``: the model as built, before shard_model."""
    root_names = [n for n, _ in model.named_parameters() if not n.startswith("layers.")]
    for rank, obs in enumerate(observations):
        params = {p["name"]: p for p in obs["params"]}
        missing = [n for n, _ in model.named_parameters() if _find(params, n) is None]
        if missing:
            g.record("dtensor-shards", False, f"rank {rank}: the module shard_model returned has no parameter "
                     f"{_some(missing)} ({len(missing)} of the model's are missing)", rank=rank, world_size=world_size)
            continue
        entries = {n: _find(params, n) for n, _ in model.named_parameters()}
        plain = [n for n, e in entries.items() if not e["dtensor"]]
        plain_root = [n for n in plain if n in root_names]
        if not plain_root:
            g.record("root-unit", True)  # sharded; check_units then follows its all-gathers
        else:
            g.record("root-unit", False,
                     f"rank {rank}: {_some(plain_root)} are plain tensors, whole on every rank: the root model was "
                     "never passed to fully_shard, so its own parameters are neither sharded nor gathered, and their "
                     "gradients are never averaged over the ranks", rank=rank, world_size=world_size)
        if plain:
            g.record("dtensor-shards", False, f"rank {rank}: {len(plain)} parameter(s) are not DTensors "
                     f"({_some(plain)}): a parameter fully_shard manages is a DTensor sharded over the mesh",
                     rank=rank, world_size=world_size)
        for name, entry in entries.items():
            if not entry["dtensor"]:
                continue
            full = dict(model.named_parameters())[name]
            want = list(local_part(full, {"dtensor": True, "placements": ["Shard(dim=0)"]}, rank, world_size).shape)
            if entry["placements"] != ["Shard(dim=0)"] or entry["mesh"] != [world_size]:
                g.record("dtensor-shards", False,
                         f"rank {rank}: {name!r} is placed ({', '.join(entry['placements'])}) on a mesh of shape "
                         f"{entry['mesh']}; expected (Shard(dim=0)) on the 1-D mesh of {world_size} ranks given to "
                         "shard_model", rank=rank, world_size=world_size)
                break
            if entry["local_shape"] != want:
                g.record("dtensor-shards", False,
                         f"rank {rank}: {name!r} (shape {entry['shape']}) holds a local shard of shape "
                         f"{entry['local_shape']}; rank {rank}'s rows of torch.chunk over {world_size} ranks are "
                         f"{want}", rank=rank, world_size=world_size)
                break
        low = [n for n, e in entries.items() if e["dtype"] != "float32"]
        if low:
            g.record("mixed-precision", False,
                     f"rank {rank}: the sharded parameters are {entries[low[0]]['dtype']} ({_some(low)}): those are "
                     "what the optimizer steps, and they stay float32; MixedPrecisionPolicy casts a gathered copy "
                     "to bfloat16 for forward and backward only", rank=rank, world_size=world_size)
    g.record("dtensor-shards", True)


def check_no_error(g: Grader, observations: list[dict], world_size: int) -> bool:
    """Record the first rank's exception in training (the cause, not a peer left waiting); True when none."""
    failed = [(rank, o) for rank, o in enumerate(observations) if o.get("error")]
    if not failed:
        return True
    failed.sort(key=lambda item: any(w in item[1]["error"].lower() for w in ("by peer", "timed out", "timeout")))
    rank, obs = failed[0]
    if checked_record(obs.get("error_record")) is not None:
        # The learner's train_step raised: the run failed, which no check's hint explains; the grading stops
        # with the exception and the learner's line, as for any exception a driver lets through.
        stop_on_learner_error(g, world_size, [(r, o.get("error_record")) for r, o in failed],
                              f"train_step, step {len(obs['steps']) + 1}")
    g.record("matches-single-process", False,
             f"rank {rank}: at step {len(obs['steps']) + 1}, train_step raised {obs['error']}",
             rank=rank, world_size=world_size)
    for check_id in AFTER_ERROR:
        g.not_checked(check_id, "matches-single-process", "train_step raised before a step was done",
                      world_size=world_size)
    return False


# --- what each step sent -------------------------------------------------------------------------


def forward_events(events: list[dict]) -> list[dict]:
    """The events before the model's forward returned (all of them when no forward was seen)."""
    marks = [i for i, e in enumerate(events) if e["op"] == "mark" and e.get("what") == "forward-returned"]
    return events[:marks[0]] if marks else events


def gathered_numels(events: list[dict]) -> list[int]:
    """What each all-gather assembled, in elements (the probe records the output's bytes)."""
    return [e["bytes"] // e.get("itemsize", 2) for e in events if e["op"] in ALL_GATHERS]


def gathered_numel(entry: dict, world_size: int) -> int:
    """Elements FSDP2's all-gather assembles for one parameter: its shard dim padded to a multiple of the
    world size (a parameter that is not a sharded DTensor counted as if it were sharded on dim 0)."""
    shape = entry["shape"]
    if not shape:
        return 1
    dim = _shard_dim(entry) or 0
    return math.ceil(shape[dim] / world_size) * world_size * math.prod(shape) // shape[dim]


def unit_sizes(params: list[dict], model, world_size: int) -> dict:
    """What one all-gather of each block, and of the root's own parameters, assembles (elements), from
    the parameters' placements as shard_model left them. ``model``: the model before shard_model."""
    named = {p["name"]: p for p in params}
    names = [n for n, _ in model.named_parameters()]
    entry = lambda n: _find(named, n) or {"shape": list(dict(model.named_parameters())[n].shape)}
    blocks = [sum(gathered_numel(entry(n), world_size) for n in names if n.startswith(f"layers.{i}."))
              for i in range(len(model.layers))]
    root_names = [n for n in names if not n.startswith("layers.")]
    return {"blocks": blocks, "root": sum(gathered_numel(entry(n), world_size) for n in root_names),
            "root_names": root_names}


def check_units(g: Grader, observations: list[dict], world_size: int, sizes: dict) -> None:
    """``sizes``: see :func:`unit_sizes`."""
    blocks, root = sizes["blocks"], sizes["root"]
    whole = sum(blocks) + root
    units_ok = True
    for rank, obs in enumerate(observations):
        for step, record in enumerate(obs["steps"]):
            where = f"step {step + 1}, rank {rank}"
            numels = gathered_numels(forward_events(record["events"]))
            others = list(numels)
            for size in blocks:
                if size in others:
                    others.remove(size)
            if len(numels) - len(others) != len(blocks):
                units_ok = False
                if whole in numels:
                    seen = (f"one all-gather of {whole} elements, the whole model: the blocks were never given to "
                            "fully_shard, so the root's one unit holds every parameter")
                elif numels and max(numels) < min(blocks):
                    seen = (f"{len(numels)} all-gathers of {sorted(numels)} elements, each smaller than a block: "
                            "each block must be one unit (fully_shard(block)), not each layer inside it")
                else:
                    seen = f"{len(numels)} all-gather(s) of {sorted(numels)} elements"
                g.record("block-units", False, f"{where}: the forward pass made {seen}; expected one all-gather "
                         f"of each of the {len(blocks)} blocks ({', '.join(map(str, blocks))} elements for "
                         f"{world_size} ranks) and the root's own parameters ({root})", rank=rank,
                         world_size=world_size)
                break
            if sum(others) != root:
                shown = f"all-gathers of {sorted(others)} elements" if others else "no other all-gather"
                g.record("root-unit", False,
                         f"{where}: besides the {len(blocks)} blocks' all-gathers the forward pass made {shown}; "
                         f"the root's own parameters ({', '.join(sizes['root_names'])}) are {root} elements for "
                         f"{world_size} ranks, gathered by the root's unit (fully_shard(model) after the blocks)",
                         rank=rank, world_size=world_size)
                break
    g.record("block-units", True)
    if units_ok:
        g.record("root-unit", True)
    else:
        g.not_checked("root-unit", "block-units", "the root's all-gathers are told apart from the blocks' ones",
                      world_size=world_size)


def check_dtypes(g: Grader, observations: list[dict], world_size: int) -> None:
    for rank, obs in enumerate(observations):
        for step, record in enumerate(obs["steps"]):
            where = f"step {step + 1}, rank {rank}"
            gathers = [e for e in forward_events(record["events"]) if e["op"] in ALL_GATHERS]
            other = sorted({e.get("dtype", "?") for e in gathers} - {"bfloat16"})
            if other:
                g.record("mixed-precision", False,
                         f"{where}: the forward pass all-gathered parameters in {', '.join(other)} "
                         f"({len(gathers)} all-gathers); with MixedPrecisionPolicy(param_dtype=torch.bfloat16) "
                         "each unit is gathered, and computes, in bfloat16", rank=rank, world_size=world_size)
            reductions = [e for e in record["events"] if e["op"] in REDUCE_SCATTERS]
            if world_size > 1 and not reductions:
                g.record("fp32-reduce", False, f"{where}: no reduce-scatter in the step: the gradients were not "
                         "reduced by FSDP", rank=rank, world_size=world_size)
            low = [e for e in reductions if e.get("dtype") != "float32"]
            if low:
                dtype = low[0].get("dtype", "?")
                g.record("fp32-reduce", False,
                         f"{where}: {len(low)} of {len(reductions)} reduce-scatter(s) of gradients ran in {dtype} "
                         f"({low[0]['bytes']} bytes for {low[0]['bytes'] // low[0].get('itemsize', 2)} elements); "
                         "MixedPrecisionPolicy's reduce_dtype defaults to param_dtype: say reduce_dtype=torch.float32",
                         rank=rank, world_size=world_size)
    g.record("mixed-precision", True)
    g.record("fp32-reduce", True)


# --- what each step did ----------------------------------------------------------------------------


def _is_sharded(observations: list[dict], name: str) -> bool:
    return _shard_dim(_find({p["name"]: p for p in observations[0]["params"]}, name)) is not None


def update_norms(observations: list[dict], step: int, lr: float) -> tuple[float, list[float]]:
    """The norm of one step's change of the whole model (a sharded parameter counted once, by its
    shards; a whole one on rank 0), and of each rank's own local values, both divided by the lr."""
    total, per_rank = 0.0, []
    for rank, obs in enumerate(observations):
        before = obs["initial"] if step == 0 else obs["steps"][step - 1]["shards"]
        after = obs["steps"][step]["shards"]
        own = 0.0
        for name, value in after.items():
            if name not in before or before[name].shape != value.shape:
                continue
            squares = float(((before[name].double() - value.double()) ** 2).sum())
            own += squares
            if rank == 0 or _is_sharded(observations, name):
                total += squares
        per_rank.append(math.sqrt(own) / lr)
    return math.sqrt(total) / lr, per_rank


def check_clipping(g: Grader, observations: list[dict], reference: dict, world_size: int) -> None:
    max_norm = reference["max_norm"]
    close = lambda value, want: abs(value - want) <= CLIP_TOLERANCE * want
    for step in range(len(observations[0]["steps"])):
        total, per_rank = update_norms(observations, step, reference["lr"])
        if close(total, max_norm):
            continue
        raw = reference["norms"][step]
        shown = ", ".join(f"{n:.4g}" for n in per_rank)
        if world_size > 1 and all(close(n, max_norm) for n in per_rank):
            seen = (f"each rank's own shards changed by max_norm ({shown}), so the model by {total:.4g}: each rank "
                    "clipped with the norm of its own shards. The norm is over every rank's shards: "
                    "clip_grad_norm_ on the DTensor gradients computes it, or all-reduce the sum of squares")
        elif step == 0 and abs(total - raw) <= 0.05 * raw:
            seen = f"the model changed by {total:.4g}, the unclipped gradient's norm ({raw:.4g}): nothing clipped it"
        else:
            seen = f"the model changed by {total:.4g} (each rank's own shards by {shown})"
        g.record("global-clip", False,
                 f"step {step + 1}: divided by the learning rate, {seen}; the gradient's norm over the whole model "
                 f"was {raw:.4g}, so clipped to max_norm={max_norm} it changes the model by {max_norm}",
                 world_size=world_size)
        return
    g.record("global-clip", True)


def check_training(g: Grader, observations: list[dict], reference: dict, world_size: int) -> None:
    initial = reference["initial"]
    for step, expected in enumerate(reference["states"]):
        for rank, obs in enumerate(observations):
            if step >= len(obs["steps"]):
                continue
            params = {p["name"]: p for p in obs["params"]}
            shards = obs["steps"][step]["shards"]
            for name, full in expected.items():
                got, entry = _find(shards, name), _find(params, name)
                want = local_part(full, entry, rank, world_size)
                before = local_part(initial[name], entry, rank, world_size)
                if got is None or tuple(got.shape) != tuple(want.shape):
                    g.record("matches-single-process", False, f"after step {step + 1}, rank {rank}: {name!r} holds "
                             f"{'nothing' if got is None else list(got.shape)}, expected {list(want.shape)}",
                             rank=rank, world_size=world_size)
                    return
                scale = float((full.double() - initial[name].double()).abs().max())
                found = tensor_difference(got.double() - before.double(), want.double() - before.double(),
                                          atol=UPDATE_TOLERANCE * scale + 1e-7)
                if found is not None:
                    g.record("matches-single-process", False,
                             f"after step {step + 1}, rank {rank}: {name!r} (this rank's shard) has moved from its "
                             "initial value differently from single-process training on the global batch "
                             f"({world_size} x {reference['batch']} sequences) in bfloat16: by up to "
                             f"{found.max_abs:.3g}, {found.max_abs / max(scale, 1e-12):.0%} of the largest change of "
                             "that parameter",
                             rank=rank, world_size=world_size)
                    return
    g.record("matches-single-process", True)


def check_loss(g: Grader, observations: list[dict], reference: dict, world_size: int) -> None:
    first = reference["losses"][0]
    mean = sum(first) / len(first)
    for rank, obs in enumerate(observations):
        for step, record in enumerate(obs["steps"]):
            loss = record["loss"]
            if loss["type"] != "float":
                g.record("returns-loss", False,
                         f"step {step + 1}, rank {rank}: train_step returned a {loss['type']}, not a Python float "
                         "(loss.item(): a tensor keeps its autograd graph alive, and a 0-d tensor on a GPU "
                         "synchronizes wherever it is read)", rank=rank, world_size=world_size)
                return
        value = obs["steps"][0]["loss"]["value"] if obs["steps"] else None
        own = first[rank]
        if value is None or not any(abs(value - want) <= LOSS_TOLERANCE * abs(want) for want in (own, mean)):
            g.record("returns-loss", False,
                     f"step 1, rank {rank}: train_step returned {value}; the loss of this rank's batch before the "
                     f"step is {own:.4f} (the mean over the ranks {mean:.4f})", rank=rank, world_size=world_size)
            return
    g.record("returns-loss", True)


def check_state_dict(g: Grader, observations: list[dict], reference: dict, world_size: int) -> None:
    state = observations[0]["state"] or {}
    if state.get("error"):
        g.record("full-state-dict", False, f"rank 0: get_model_state_dict(model, options=StateDictOptions("
                 f"full_state_dict=True, cpu_offload=True)) raised {state['error']}", rank=0, world_size=world_size)
        return
    expected = reference["initial"]
    keys = state.get("keys", [])
    missing = [k for k in expected if k not in keys]
    extra = [k for k in keys if k not in expected]
    if missing or extra:
        g.record("full-state-dict", False,
                 f"rank 0: the full state dict lacks {len(missing)} of the model's {len(expected)} keys "
                 f"({_some(missing) if missing else 'none'}) and has {len(extra)} others "
                 f"({_some(extra) if extra else 'none'})", rank=0, world_size=world_size)
        return
    last = lambda obs: obs["steps"][-1]["shards"]
    for key, want in expected.items():
        value = state["tensors"].get(key)
        if value is None:
            g.record("full-state-dict", False, f"rank 0: the full state dict's {key!r} is a "
                     f"{state['types'].get(key)}, not a whole tensor", rank=0, world_size=world_size)
            return
        if tuple(value.shape) != tuple(want.shape) or value.dtype != want.dtype:
            g.record("full-state-dict", False,
                     f"rank 0: the full state dict's {key!r} has shape {list(value.shape)} and dtype "
                     f"{str(value.dtype).removeprefix('torch.')}; the model's parameter has shape {list(want.shape)} "
                     f"and dtype {str(want.dtype).removeprefix('torch.')}", rank=0, world_size=world_size)
            return
        trained = assemble(observations, last, key)
        found = None if trained is None else tensor_difference(value, trained)
        if found is not None:
            g.record("full-state-dict", False,
                     f"rank 0: the full state dict's {key!r} is not the ranks' shards put together: {found}",
                     rank=0, world_size=world_size)
            return
    g.record("full-state-dict", True)
