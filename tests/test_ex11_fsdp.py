"""Exercise 11's models, replay and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import torch

from grader.rank.drivers import ex11_fsdp as rank_side
from grader.checks.ex11_fsdp import reference as ref
from grader.checks.ex11_fsdp import verdicts as v
from grading_helpers import grading_for, verdicts


grading = grading_for("11")


def test_the_even_model_needs_no_padding_and_the_uneven_one_needs_it_at_every_world_size():
    for world_size in (2, 3, 4):
        assert all(n % world_size == 0 for n in rank_side.unit_sizes("sgd").values())
        assert any(n % world_size for n in rank_side.unit_sizes("uneven").values())


def test_no_units_slice_has_the_size_of_a_whole_unit():
    """So that an all-gather recorded by its input (functional collectives) is not taken for another unit's."""
    for plan in ("sgd", "uneven"):
        for world_size in (2, 3, 4):
            whole = {ref.padded(n, world_size) for n in rank_side.unit_sizes(plan).values()}
            slices = {size // world_size for size in whole}
            assert not whole & slices, (plan, world_size, whole & slices)


def test_a_slice_never_holds_a_units_whole_weight():
    """Else a rank's own slice would count as its unit gathered."""
    for plan in ("sgd", "uneven"):
        model = rank_side.build_model(0, plan)
        for unit, key in rank_side.WEIGHT_OF.items():
            weight = model.state_dict()[key]
            assert weight.numel() > ref.padded(rank_side.unit_sizes(plan)[unit], 2) // 2, (plan, unit)


def test_the_ranks_models_differ_and_the_frozen_parameter_is_frozen():
    a, b = rank_side.build_model(0, "sgd"), rank_side.build_model(1, "sgd")
    assert not torch.equal(a.embed.weight, b.embed.weight)
    assert not a.block.gain.requires_grad and rank_side.FROZEN in a.state_dict()


def test_the_adamw_replay_is_torch_adamw_on_the_global_batch():
    world_size = 3
    model = rank_side.build_model(0, "adamw")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **rank_side.ADAMW)
    for step in range(rank_side.STEPS):
        batches = [rank_side.make_batch(step, rank, "adamw") for rank in range(world_size)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    replay = ref.reference_states("adamw", world_size)[-1]
    for name, value in model.state_dict().items():
        assert torch.allclose(value, replay[name], rtol=1e-12, atol=1e-14), name


def _events(world_size: int, *, backward_gathers: int | None = None, extra: list | None = None,
            list_form: bool = False) -> list[dict]:
    sizes = list(rank_side.unit_sizes("sgd").values())
    full = [ref.padded(n, world_size) * 4 for n in sizes]
    if list_form:  # all_gather(tensor_list, tensor): the probe records the input slice
        gathers = [{"op": "all_gather", "bytes": b // world_size} for b in full]
    else:
        gathers = [{"op": "all_gather_single", "bytes": b} for b in full]
    backward = gathers[::-1][:len(sizes) if backward_gathers is None else backward_gathers]
    reduces = [{"op": "reduce_scatter_single", "bytes": b // world_size} for b in full]
    return gathers + [{"op": "mark", "what": "forward-returned"}] + backward + reduces + (extra or [])


def _collectives(events: list[dict]) -> list[dict]:
    return [{"steps": [{"events": events}]}]


def test_the_expected_collectives_pass_in_either_form_and_with_the_first_units_backward_gather_skipped():
    for world_size in (2, 3):
        for events in (_events(world_size), _events(world_size, list_form=True),
                       _events(world_size, backward_gathers=3)):
            g = grading(world_size)
            v.check_collectives(g, _collectives(events), world_size)
            got = verdicts(g)
            assert got["gathers-per-unit"][0] == "pass" and got["reduce-scatter-grads"][0] == "pass"


def test_functional_collectives_recorded_by_their_inputs_pass():
    """torch.distributed._functional_collectives: the probe records each call's input."""
    world_size = 2
    events = []
    for e in _events(world_size):
        if e["op"] == "all_gather_single":
            events.append({"op": "all_gather_into_tensor", "bytes": e["bytes"] // world_size})
        elif e["op"] == "reduce_scatter_single":
            events.append({"op": "reduce_scatter_tensor", "bytes": e["bytes"] * world_size})
        else:
            events.append(e)
    g = grading(world_size)
    v.check_collectives(g, _collectives(events), world_size)
    got = verdicts(g)
    assert got["gathers-per-unit"][0] == "pass" and got["reduce-scatter-grads"][0] == "pass"


def test_no_gather_in_backward_fails():
    g = grading()
    v.check_collectives(g, _collectives(_events(2, backward_gathers=0)), 2)
    status, message = verdicts(g)["gathers-per-unit"]
    assert status == "fail" and "all-gathered 0 time(s)" in message


def test_an_all_reduce_fails_and_is_named():
    g = grading()
    v.check_collectives(g, _collectives(_events(2, extra=[{"op": "all_reduce", "bytes": 2400}])), 2)
    status, message = verdicts(g)["reduce-scatter-grads"]
    assert status == "fail" and "all_reduce of 2400 bytes" in message
    assert verdicts(g)["gathers-per-unit"][0] == "pass"


def test_one_gather_per_parameter_fails():
    events = _events(2)
    split = []
    for e in events:
        if e["op"] == "all_gather_single":  # a weight and a bias instead of the unit's one buffer
            split += [{"op": e["op"], "bytes": e["bytes"] - 96}, {"op": e["op"], "bytes": 96}]
        else:
            split.append(e)
    g = grading()
    v.check_collectives(g, _collectives(split), 2)
    assert verdicts(g)["gathers-per-unit"][0] == "fail"


def _probes(gathered: list[list[str]], fingerprints=rank_side.UNITS) -> list[dict]:
    steps = [{"probes": []} for _ in range(rank_side.STEPS)]
    steps[rank_side.PROBED_STEP]["probes"] = [{"phase": "forward", "unit": rank_side.UNITS[i % 4], "gathered": units}
                                       for i, units in enumerate(gathered)]
    steps[rank_side.PROBED_STEP]["probes"].append({"phase": "fingerprints", "units": sorted(fingerprints)})
    return [{"steps": steps}]


def test_two_units_in_memory_pass_and_three_fail():
    g = grading()
    v.check_probes(g, _probes([["embed"], ["embed", "block"], ["block", "hidden"]]), 2)
    assert verdicts(g)["two-units-at-a-time"][0] == "pass"
    g = grading()
    v.check_probes(g, _probes([["embed"], ["embed", "block"], ["embed", "block", "hidden"]]), 2)
    status, message = verdicts(g)["two-units-at-a-time"]
    assert status == "fail" and "3 units were in memory (embed, block, hidden)" in message


def test_units_that_could_not_be_followed_fail():
    g = grading()
    v.check_probes(g, _probes([["embed"]], fingerprints=("embed", "block")), 2)
    status, message = verdicts(g)["two-units-at-a-time"]
    assert status == "fail" and "hidden" in message


def _held(nbytes: int, units=()) -> list[dict]:
    return [{"trainable_numel": 0, "steps": [{"held": nbytes, "held_units": list(units)}]}]


def test_held_bytes_within_the_slices_pass_and_a_full_copy_fails():
    for world_size in (2, 4):
        sizes = ref.expected_held(world_size)
        g = grading(world_size)
        v.check_held(g, _held(sizes["slices"] + sizes["whole"]), world_size)
        assert verdicts(g)["sharded-between-steps"][0] == "pass"
        g = grading(world_size)
        v.check_held(g, _held(sizes["slices"] + sizes["whole"] + sizes["full"]), world_size)
        status, message = verdicts(g)["sharded-between-steps"]
        assert status == "fail" and "1.0 x the model's full parameters" in message


def test_a_unit_found_whole_between_steps_fails():
    g = grading()
    v.check_held(g, _held(100, units=["head"]), 2)
    status, message = verdicts(g)["sharded-between-steps"]
    assert status == "fail" and "head" in message


def test_the_first_rank_to_fail_is_named_not_the_one_left_waiting():
    g = grading()
    ok = v.check_no_error(g, "uneven-sizes", [{"error": "RuntimeError: Connection closed by peer"},
                                         {"error": "RuntimeError: invalid tensor size"}], "the model", 2)
    status, message = verdicts(g)["uneven-sizes"]
    assert not ok and status == "fail" and "rank 1 raised RuntimeError: invalid tensor size" in message


def test_summed_gradients_are_named_from_the_sgd_update():
    world_size = 2
    reference = ref.reference_states("sgd", world_size)
    initial = rank_side.build_model(0, "sgd").state_dict()
    doubled = {k: initial[k] + 2 * (v - initial[k]) for k, v in reference[0].items()}
    obs = {"initial": initial, "steps": [{"state": doubled}] + [{"state": s} for s in reference[1:]]}
    g = grading(world_size)
    v.check_training(g, "matches-sgd", [obs], "sgd", world_size)
    status, message = verdicts(g)["matches-sgd"]
    assert status == "fail" and "2 x the expected one" in message
