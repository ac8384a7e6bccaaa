"""Exercise 32's verdicts, from the ranks' records (grader side): the mesh, each parameter's placements
over "tp" and "dp", the norms' sequence parallelism, the group of every collective, and the logits and
parameters against the dense model.

A record is what the driver returned for one rank: ``mesh`` (device type, shape, dim names, the global
ranks in place), ``params`` (each parameter: DTensor or not, placements, the names, shape and rank
layout of its mesh and this rank's coordinate there, global and local shape), ``initial`` and each
step's ``locals`` (local values), ``norms`` (what each norm received in the first forward), ``output``
(the first forward's logits, local values and placements), ``setup_events`` and each step's ``events``
(collectives with the global ranks of their group), ``error``, ``parallelize_error``.

Placements are read by grader/checks/shared/dtensors.py (parse, expected_local)."""

from __future__ import annotations

import torch

from grader.rank import probes
from grader.checks.interface import Grader
from grader.checks.shared.dtensors import expected_local, find as _find, parse
from grader.checks.shared.learner_errors import checked_record, stop_on_learner_error
from grader.compare import tensor_difference

COLWISE = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w1.weight",
           "output.weight")
ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")
NORMS = ("attention_norm.weight", "ffn_norm.weight", "norm.weight")
CHECKS = ("mesh", "tp-placements", "dp-shards", "sequence-parallel", "subgroups", "block-units", "gathers-per-forward",
          "matches-dense")
STAGE_CHECK = {"device_mesh": "mesh", "parallelize_module": "tp-placements", "fully_shard": "dp-shards"}
FSDP_OPS = probes.ALL_GATHERS + probes.REDUCE_SCATTERS
LOGITS_TOLERANCE = 1e-4  # absolute, float32 logits of size ~1 summed in another order
UPDATE_TOLERANCE = 1e-3  # of the largest change of a parameter over the steps so far




def _placed(entry: dict) -> str:
    if not entry.get("dtensor"):
        return f"a plain {entry.get('kind', 'tensor')}, whole on every rank"
    return f"placed ({', '.join(entry['placements'])}) on a mesh {tuple(entry['mesh_names'])} of shape " \
           f"{tuple(entry['mesh_shape'])}"


# --- placements ---------------------------------------------------------------------------------------








def groups_of(rank: int, world_size: int, tp_size: int) -> tuple[list[int], list[int]]:
    """Rank ``rank``'s tensor-parallel group (its row: neighbouring ranks) and data-parallel group (its
    column) in the mesh ("dp", "tp") of shape (world_size // tp_size, tp_size)."""
    row = rank // tp_size
    return list(range(row * tp_size, (row + 1) * tp_size)), list(range(rank % tp_size, world_size, tp_size))


# --- parallelize raised, or returned something else --------------------------------------------------


def check_parallelize(g: Grader, observations: list[dict], world_size: int) -> bool | None:
    """True when parallelize returned on every rank; False when it raised in the mesh, parallelize_module or
    fully_shard (recorded on the check of that step); None when it raised elsewhere (the grading stops)."""
    failed = [(rank, o["parallelize_error"]) for rank, o in enumerate(observations) if o.get("parallelize_error")]
    if not failed:
        return True
    rank, error = failed[0]
    check_id = STAGE_CHECK.get(error["stage"])
    if check_id is None:
        return None
    api = {"device_mesh": "building the DeviceMesh", "parallelize_module": "parallelize_module",
           "fully_shard": "fully_shard"}[error["stage"]]
    where = f" ({error['line']})" if error.get("line") else ""
    why = ""
    if "Cannot distribute a DTensor" in error["error"]:
        why = (": the parameters were already DTensors over another mesh when tensor parallelism was applied, so "
               "fully_shard ran first. Apply the plan first, then fully_shard, which shards each DTensor the plan "
               "made once more, on dim 0 over \"dp\"")
    elif "overlapping meshes" in error["error"]:
        why = (": fully_shard was given a mesh that includes \"tp\", the dimension the plan already split the "
               "parameters over (the whole 2-D mesh): give it mesh[\"dp\"]")
    g.record(check_id, False, f"rank {rank}: parallelize raised in {api}{where}: {error['error']}{why}",
             rank=rank, world_size=world_size)
    for other in CHECKS:
        if other != check_id:
            g.not_checked(other, check_id, "parallelize raised", world_size=world_size)
    return False


# --- the mesh -------------------------------------------------------------------------------------------


def mesh_problem(mesh: dict, world_size: int, tp_size: int, device_type: str) -> str | None:
    dp = world_size // tp_size
    if mesh.get("type") != "DeviceMesh":
        return f"parallelize returned a {mesh.get('type')} as its second value, not the DeviceMesh"
    names, shape, layout = mesh["names"], mesh["shape"], mesh["layout"]
    want_shape, want_layout = [dp, tp_size], [[d * tp_size + t for t in range(tp_size)] for d in range(dp)]
    shown = f"shape {tuple(shape)}, dims named {tuple(names)}"
    if len(shape) != 2:
        return (f"the mesh is {len(shape)}-D ({shown}); expected 2-D: shape (world_size // tp_size, tp_size) = "
                f"{tuple(want_shape)}, named ('dp', 'tp')")
    if names == ["tp", "dp"]:
        return (f"the mesh's dimensions are swapped ({shown}): \"dp\" is the outer dimension and \"tp\" the inner "
                f"one, shape {tuple(want_shape)} named ('dp', 'tp'), so that each tensor-parallel group is "
                f"{tp_size} neighbouring ranks (one node's GPUs)")
    if names != ["dp", "tp"]:
        return f"the mesh's dims are named {tuple(names)}; expected ('dp', 'tp') ({shown})"
    if shape != want_shape:
        swapped = " the sizes are swapped:" if shape == want_shape[::-1] else ""
        return (f"the mesh has shape {tuple(shape)}:{swapped} {shape[0]} data-parallel group(s) of {shape[1]} "
                f"rank(s); for world_size={world_size} and tp_size={tp_size} it is {tuple(want_shape)}")
    if layout != want_layout:
        tp_groups = ", ".join(str(row) for row in layout)
        swapped = " (the dimensions are swapped in the layout)" if layout == [list(c) for c in zip(*want_layout)] \
            else ""
        return (f"the mesh lays out the ranks as {layout}, so its tensor-parallel groups are {tp_groups}"
                f"{swapped}; with \"tp\" the inner dimension they are neighbouring ranks: {want_layout}")
    if mesh["device_type"] != device_type:
        return f"the mesh is for device type {mesh['device_type']!r}; this rank's model is on {device_type!r}"
    return None


def check_mesh(g: Grader, observations: list[dict], world_size: int, tp_size: int) -> None:
    for rank, obs in enumerate(observations):
        problem = mesh_problem(obs["mesh"], world_size, tp_size, obs["device_type"])
        if problem:
            g.record("mesh", False, f"rank {rank}: {problem}", rank=rank, world_size=world_size)
            return
    g.record("mesh", True)


# --- placements over "tp" and "dp" ----------------------------------------------------------------------


def _swapped_meshes(entry: dict) -> str:
    if entry.get("mesh_names") == ["tp", "dp"]:
        return (". Its mesh is named ('tp', 'dp'): a parameter that fully_shard shards after tensor parallelism "
                "lives on fully_shard's mesh then the plan's, so fully_shard got mesh[\"tp\"] and "
                "parallelize_module got mesh[\"dp\"]: the dimensions are swapped where they are used")
    return ""


def tp_problem(name: str, entry: dict | None, dim: int, tp_size: int) -> str | None:
    role = "column-parallel" if dim == 0 else "row-parallel"
    features = "output features (rows of the weight)" if dim == 0 else "input features (columns of the weight)"
    style = "ColwiseParallel()" if dim == 0 else "RowwiseParallel()"
    if entry is None:
        return f"the module parallelize returned has no parameter {name!r}"
    if not entry["dtensor"] or "tp" not in entry["mesh_names"]:
        return (f"{name!r} is {_placed(entry)}: tensor parallelism never split it over \"tp\". A {role} "
                f"linear is split by its {features}: {style} in the plan, Shard({dim}) on \"tp\"")
    k = entry["mesh_names"].index("tp")
    kind = parse(entry["placements"][k])
    if kind[:2] not in (("shard", dim), ("strided", dim)):
        if kind[0] in ("shard", "strided") and kind[1] == 1 - dim:
            seen = (f"split by its {'input' if dim == 0 else 'output'} features, as a "
                    f"{'row' if dim == 0 else 'column'}-parallel layer is: the plan swapped ColwiseParallel and "
                    "RowwiseParallel")
        else:
            seen = "not split by its features"
        return (f"{name!r} is {_placed(entry)}: on \"tp\" it is {entry['placements'][k]}, {seen}. A {role} "
                f"linear is split by its {features}: Shard({dim}) on \"tp\"{_swapped_meshes(entry)}")
    if entry["mesh_shape"][k] != tp_size:
        return f"{name!r} is {_placed(entry)}: its \"tp\" dimension has {entry['mesh_shape'][k]} ranks, not {tp_size}"
    return None


def check_tp_placements(g: Grader, observations: list[dict], world_size: int, tp_size: int,
                        names: list[str]) -> None:
    """``names``: the model's parameter names, in order."""
    linears = [(n, 0) for n in names if n.endswith(COLWISE)] + [(n, 1) for n in names if n.endswith(ROWWISE)]
    for rank, obs in enumerate(observations):
        for name, dim in linears:
            problem = tp_problem(name, _find(obs["params"], name), dim, tp_size)
            if problem:
                g.record("tp-placements", False, f"rank {rank}: {problem}", rank=rank, world_size=world_size)
                return
    g.record("tp-placements", True)


def dp_problem(name: str, entry: dict | None, full_shape: list[int], dp: int) -> str | None:
    if entry is None:
        return f"the module parallelize returned has no parameter {name!r}"
    if not entry["dtensor"] or "dp" not in entry["mesh_names"]:
        return (f"{name!r} is {_placed(entry)}: it is not sharded over \"dp\", so every data-parallel group holds "
                "all of it and nothing averages its gradient over the groups: fully_shard each block, then the "
                "root, over mesh[\"dp\"], after tensor parallelism")
    k = entry["mesh_names"].index("dp")
    kind = parse(entry["placements"][k])
    if kind[:2] not in (("shard", 0), ("strided", 0)):
        return (f"{name!r} is {_placed(entry)}: on \"dp\" it is {entry['placements'][k]}; fully_shard shards "
                f"dim 0 over \"dp\" (Shard(0), shown as _StridedShard(dim=0) where the plan split dim 0 too)"
                f"{_swapped_meshes(entry)}")
    if entry["mesh_shape"][k] != dp:
        return f"{name!r} is {_placed(entry)}: its \"dp\" dimension has {entry['mesh_shape'][k]} ranks, not {dp}"
    want = expected_local(torch.empty(full_shape), entry)
    if want is not None and list(want.shape) != entry["local_shape"]:
        return (f"{name!r} (shape {full_shape}) is {_placed(entry)} and this rank holds {entry['local_shape']}; "
                f"its part by those placements is {list(want.shape)}")
    return None


def check_dp_shards(g: Grader, observations: list[dict], world_size: int, tp_size: int, shapes: dict) -> None:
    """``shapes``: the model's parameter names and full shapes, in order."""
    for rank, obs in enumerate(observations):
        for name, shape in shapes.items():
            problem = dp_problem(name, _find(obs["params"], name), shape, world_size // tp_size)
            if problem:
                g.record("dp-shards", False, f"rank {rank}: {problem}", rank=rank, world_size=world_size)
                return
    g.record("dp-shards", True)


# --- the norms run on a slice of the sequence -------------------------------------------------------------


def check_sequence_parallel(g: Grader, observations: list[dict], world_size: int, tp_size: int, seq: int,
                            names: list[str]) -> None:
    """``seq``: the batch's sequence length; ``names``: the model's parameter names, in order."""
    norms = [n for n in names if n.endswith(NORMS)]
    for rank, obs in enumerate(observations):
        for name in norms:
            entry = _find(obs["params"], name)
            tp = entry["mesh_names"].index("tp") if entry and entry["dtensor"] and "tp" in entry["mesh_names"] \
                else None
            if entry is not None and (tp is None or entry["placements"][tp] != "Replicate()"):
                g.record("sequence-parallel", False,
                         f"rank {rank}: the norm weight {name!r} is {_placed(entry)}, not replicated over \"tp\". "
                         "SequenceParallel() makes a norm's weight Replicate() on \"tp\" and sums its gradient over "
                         "the group's slices of the sequence; a norm left out of the plan runs on whatever it "
                         "receives, and each rank's copy of its weight learns from that rank's slice alone",
                         rank=rank, world_size=world_size)
                return
        for module, seen in obs.get("norms", {}).items():
            length = seen["local_shape"][1] if len(seen["local_shape"]) > 1 else None
            if length != seq // tp_size:
                whole = " (the whole sequence)" if length == seq else ""
                g.record("sequence-parallel", False,
                         f"rank {rank}: in the first forward {module!r} normalised {length} positions{whole} of "
                         f"each sequence on this rank (its input: {_placed(seen)}, local shape "
                         f"{seen['local_shape']}); with sequence parallelism each of the {tp_size} ranks of a "
                         f"tensor-parallel group normalises its own {seq // tp_size} of the {seq}: SequenceParallel() "
                         "for the norm, and the layers before it return Shard(1) (RowwiseParallel("
                         "output_layouts=Shard(1)))", rank=rank, world_size=world_size)
                return
    g.record("sequence-parallel", True)


# --- the group of every collective ------------------------------------------------------------------


def _summary(events: list[dict]) -> str:
    counts: dict[str, int] = {}
    for e in events:
        counts[e["op"]] = counts.get(e["op"], 0) + 1
    sizes = sorted({e["bytes"] for e in events})
    return ", ".join(f"{n} {op}" for op, n in counts.items()) + f" ({', '.join(map(str, sizes[:3]))}" \
        + (", ..." if len(sizes) > 3 else "") + " bytes)"


def check_subgroups(g: Grader, observations: list[dict], world_size: int, tp_size: int) -> None:
    """Every collective ran among the rank's tensor-parallel group or its data-parallel group; in the steps,
    DTensor's redistributions (tensor-parallel traffic) among the first, FSDP's all-gathers and
    reduce-scatters among the second."""
    for rank, obs in enumerate(observations):
        tp, dp = groups_of(rank, world_size, tp_size)
        phases = [("in parallelize", obs.get("setup_events", []))] + \
                 [(f"in step {i + 1}", s["events"]) for i, s in enumerate(obs.get("steps", []))]
        for phase, events in phases:
            known = [e for e in events if e.get("group") is not None]
            stray = [e for e in known if e["group"] not in (tp, dp)]
            if stray:
                group = stray[0]["group"]
                same = [e for e in stray if e["group"] == group]
                whole = " (the whole world)" if group == list(range(world_size)) else ""
                g.record("subgroups", False,
                         f"rank {rank}, {phase}: {_summary(same)} ran among ranks {group}{whole}; this rank's "
                         f"tensor-parallel group is {tp} and its data-parallel group {dp}, and every collective of "
                         "2-D parallelism runs inside one of them", rank=rank, world_size=world_size)
                return
            if phase == "in parallelize" or tp == dp:
                continue
            tensor_parallel = [e for e in known if e["via"] == "functional" and e["group"] != tp]
            fsdp = [e for e in known if e["via"] == "c10d" and e["op"] in FSDP_OPS and e["group"] != dp]
            if tensor_parallel or fsdp:
                parts = []
                if tensor_parallel:
                    parts.append(f"DTensor's tensor-parallel collectives ({_summary(tensor_parallel)}) ran among "
                                 f"ranks {tensor_parallel[0]['group']}, its data-parallel group")
                if fsdp:
                    parts.append(f"FSDP's parameter gathers and gradient reductions ({_summary(fsdp)}) ran among "
                                 f"ranks {fsdp[0]['group']}, its tensor-parallel group")
                g.record("subgroups", False,
                         f"rank {rank}, {phase}: {'; '.join(parts)}. Activations move every layer and belong "
                         f"among the neighbouring ranks {tp} (\"tp\", the inner dimension); FSDP's traffic among "
                         f"{dp} (\"dp\"): the \"tp\" and \"dp\" dimensions are swapped, in the mesh or in which "
                         "sub-mesh the plan and fully_shard get", rank=rank, world_size=world_size)
                return
    g.record("subgroups", True)


# --- what one forward sends ------------------------------------------------------------------------------


def forward_events(events: list[dict]) -> list[dict] | None:
    """The events of a step before its forward returned (None when the mark is missing)."""
    end = next((i for i, e in enumerate(events) if e.get("op") == "mark"), None)
    return None if end is None else events[:end]


def _gathers(events: list[dict], group: list[int], via: str) -> list[dict]:
    return [e for e in events if e.get("op") in probes.ALL_GATHERS and e.get("via") == via and e.get("group") == group]


def check_units(g: Grader, observations: list[dict], world_size: int, tp_size: int, layers: int) -> None:
    """Each step's forward gathers each block's parameters in an all-gather of its own among the data-parallel
    group, and the root's own parameters in one more: the FSDP units are the blocks and the root."""
    for rank, obs in enumerate(observations):
        _, dp = groups_of(rank, world_size, tp_size)
        for step, record in enumerate(obs.get("steps", [])):
            events = forward_events(record["events"])
            if events is None:
                continue
            gathers = _gathers(events, dp, "c10d")
            if len(gathers) == layers + 1:
                continue
            sizes = [e["bytes"] for e in gathers]
            if len(gathers) == 1:
                seen = (f"one all-gather of {sizes[0]} bytes among its data-parallel group {dp}: every parameter of "
                        "the model in one FSDP unit, the root's, gathered whole at the start of each forward and "
                        "held until it ends. fully_shard each block first (for block in model.layers: "
                        "fully_shard(block, mesh=mesh[\"dp\"])), then the root")
            elif len(gathers) > layers + 1:
                seen = (f"{len(gathers)} all-gathers among its data-parallel group {dp} ({_bytes_list(sizes)} bytes): "
                        "units smaller than a block; each block is one unit (fully_shard(block)), not each layer "
                        "inside it")
            else:
                seen = (f"{len(gathers)} all-gather(s) among its data-parallel group {dp} ({_bytes_list(sizes)} "
                        "bytes): some blocks are not units of their own")
            g.record("block-units", False, f"rank {rank}, step {step + 1}: the forward made {seen}; expected one "
                     f"all-gather per block ({layers}) and one of the root's own parameters", rank=rank,
                     world_size=world_size)
            return
    g.record("block-units", True)


def _bytes_list(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes[:6])) + (", ..." if len(sizes) > 6 else "")


def most_forward_gathers(layers: int) -> int:
    """Activation all-gathers one forward needs at most: once before attention and once before the MLP in each
    block (PrepareModuleInput), once before the head, and once for the logits when they are made whole."""
    return 2 * layers + 2


def check_forward_gathers(g: Grader, observations: list[dict], world_size: int, tp_size: int, layers: int) -> None:
    """DTensor's all-gathers of activations among the tensor-parallel group in each step's forward: at most
    most_forward_gathers, whichever way the plan gets there."""
    most = most_forward_gathers(layers)
    for rank, obs in enumerate(observations):
        tp, _ = groups_of(rank, world_size, tp_size)
        if len(tp) < 2:
            continue
        for step, record in enumerate(obs.get("steps", [])):
            events = forward_events(record["events"])
            if events is None:
                continue
            gathers = _gathers(events, tp, "functional")
            if len(gathers) <= most:
                continue
            g.record("gathers-per-forward", False,
                     f"rank {rank}, step {step + 1}: the forward made {len(gathers)} all-gathers of activations among "
                     f"its tensor-parallel group {tp} ({_bytes_list([e['bytes'] for e in gathers])} bytes); it needs "
                     f"{most} at most: the sequence gathered once before each block's attention and once before its "
                     f"MLP ({layers} blocks), once before the head, and once for the logits. A sequence-split input "
                     "that reaches wq, wk and wv (or w1) as it is is gathered by each of them: PrepareModuleInput("
                     "input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)) on attention and on "
                     "feed_forward gathers it once", rank=rank, world_size=world_size)
            return
    g.record("gathers-per-forward", True)


# --- against the dense model ----------------------------------------------------------------------------


def check_training_error(g: Grader, observations: list[dict], world_size: int) -> bool:
    """Record the first rank's exception in training (the cause, not a peer left waiting); True when none."""
    failed = [(rank, o) for rank, o in enumerate(observations) if o.get("error")]
    if not failed:
        return True
    failed.sort(key=lambda item: any(w in item[1]["error"].lower() for w in ("by peer", "timed out", "timeout")))
    rank, obs = failed[0]
    if checked_record(obs.get("error_record")) is not None:
        # The learner's parallelized model raised in a step: the run failed, which no check's hint explains;
        # the grading stops with the exception and the learner's line, as for any exception a driver lets through.
        stop_on_learner_error(g, world_size, [(r, o.get("error_record")) for r, o in failed],
                              f"step {len(obs['steps']) + 1}: logits = model(tokens), loss_fn, backward, SGD")
    g.record("matches-dense", False, f"rank {rank}: step {len(obs['steps']) + 1} raised {obs['error']} (the grader's "
             "step: logits = model(tokens), loss_fn, backward, SGD)", rank=rank, world_size=world_size)
    return False


def check_matches_dense(g: Grader, observations: list[dict], reference: dict, world_size: int,
                        tp_size: int) -> None:
    """``reference``: the dense run (see ex32's reference_run): ``logits`` of each data-parallel group's batch
    at the first step, ``initial`` and each step's ``states``."""
    for rank, obs in enumerate(observations):
        output, full = obs["output"], reference["logits"][rank // tp_size]
        want = expected_local(full, output)
        found = None if want is None else tensor_difference(output["local"], want, atol=LOGITS_TOLERANCE)
        if want is None or found is not None:
            what = f"placed {output.get('placements')}" if want is None else str(found)
            g.record("matches-dense", False,
                     f"rank {rank}: the first forward's logits ({_placed(output)}, local shape {output['local_shape']}) "
                     f"are not the dense model's on this rank's batch (data-parallel group {rank // tp_size}): {what}",
                     rank=rank, world_size=world_size)
            return
    initial = reference["initial"]
    for step, expected in enumerate(reference["states"]):
        for rank, obs in enumerate(observations):
            if step >= len(obs["steps"]):
                continue
            for name, full in expected.items():
                entry, got = _find(obs["params"], name), _find(obs["steps"][step]["locals"], name)
                if entry is None or got is None:
                    g.record("matches-dense", False, f"after step {step + 1}, rank {rank}: the model has no "
                             f"parameter {name!r}", rank=rank, world_size=world_size)
                    return
                want, before = expected_local(full, entry), expected_local(initial[name], entry)
                if want is None or tuple(got.shape) != tuple(want.shape):
                    wanted = f"placed {entry.get('placements')}" if want is None else f"{list(want.shape)}"
                    g.record("matches-dense", False,
                             f"after step {step + 1}, rank {rank}: {name!r} holds {list(got.shape)}; its part of the dense "
                             f"model's parameter by its placements is {wanted}", rank=rank, world_size=world_size)
                    return
                scale = max(float((s[name] - initial[name]).abs().max()) for s in reference["states"][:step + 1])
                found = tensor_difference(got.double() - before.double(), want.double() - before.double(),
                                          atol=UPDATE_TOLERANCE * scale + 1e-7)
                if found is not None:
                    g.record("matches-dense", False,
                             f"after step {step + 1}, rank {rank}: {name!r} (this rank's part, {_placed(entry)}) has "
                             "moved from its initial value differently from the dense model trained in one process "
                             f"on every data-parallel group's batch: by up to {found.max_abs:.3g}, "
                             f"{found.max_abs / max(scale, 1e-12):.0%} of the largest change of that parameter",
                             rank=rank, world_size=world_size)
                    return
    g.record("matches-dense", True)
