"""Exercise 51's model, replay and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import torch

from grader.checks.ex51_prefetch_fsdp import reference as ref
from grader.checks.ex51_prefetch_fsdp import verdicts as v
from grader.rank.drivers import ex51_prefetch_fsdp as rank_side
from grading_helpers import grading_for, verdicts

grading = grading_for("51")
UNITS = list(rank_side.UNITS)


def test_each_collectives_size_names_one_unit_at_every_world_size():
    for world_size in (2, 3, 4):
        whole, sliced = ref.gathered_sizes(world_size), ref.slice_sizes(world_size)
        assert sorted(whole.values()) == sorted(UNITS) == sorted(sliced.values())
        assert not set(whole) & set(sliced), world_size
        assert list(whole.values()) == UNITS  # in the order the units run


def test_a_slice_never_holds_a_units_whole_weight():
    """Else a rank's own slice would count as its unit gathered."""
    model = rank_side.build_model(0, 0)
    for unit, key in rank_side.WEIGHT_OF.items():
        assert model.state_dict()[key].numel() > ref.padded(rank_side.unit_sizes()[unit], 2) // 2, unit


def test_the_ranks_models_differ_and_the_seed_changes_every_input():
    a, b = rank_side.build_model(7, 0), rank_side.build_model(7, 1)
    assert not torch.equal(a.embed.weight, b.embed.weight)
    assert not torch.equal(rank_side.build_model(8, 0).embed.weight, a.embed.weight)
    assert not torch.equal(rank_side.make_batch(7, 0, 0)[0], rank_side.make_batch(8, 0, 0)[0])
    assert not torch.equal(rank_side.make_batch(7, 0, 0)[0], rank_side.make_batch(7, 0, 1)[0])


def test_the_replay_cuts_the_global_gradient_into_the_ranks_slices():
    world_size, seed = 3, 5
    reference = ref.reference_steps(seed, world_size)
    model = rank_side.build_model(seed, 0)
    batches = [rank_side.make_batch(seed, 0, r) for r in range(world_size)]
    x, y = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    torch.nn.functional.mse_loss(model(x), y).backward()
    grad = model.block.linear.weight.grad.reshape(-1)
    got = torch.cat(reference["steps"][0]["grads"]["block"])[:grad.numel()]
    assert torch.allclose(got, grad, rtol=1e-12, atol=1e-15)
    assert torch.equal(reference["steps"][0]["outputs"][1], rank_side.build_model(seed, 0)(batches[1][0]))


# --- hand-made records -----------------------------------------------------------------------------------


def step_events(world_size: int = 2, *, wait_at_once=False, issue_after=False, blocking_gather=False,
                backward_prefetch=True, keep_last=False, rs_in_finish=False, rs_waited_in_hook=False,
                rs_late=False, all_reduce=False) -> list[dict]:
    """One step's events as the reference's ranks record them, or as a variant changes them."""
    whole = {name: size for size, name in ref.gathered_sizes(world_size).items()}
    part = {name: size for size, name in ref.slice_sizes(world_size).items()}
    events, ids = [], iter(range(1000))
    works: dict[str, int] = {}

    def issue(op, size, blocking=False):
        n = next(ids)
        events.append({"op": op, "bytes": size, "async_op": not blocking, "id": n})
        if blocking:
            events.append({"op": "wait", "id": n, "blocking": True})
        return n

    def gather(unit):
        works[unit] = issue("all_gather_single", whole[unit], blocking_gather)
        if wait_at_once:
            events.append({"op": "wait", "id": works[unit]})

    def wait(unit):
        if unit in works:
            events.append({"op": "wait", "id": works.pop(unit)})

    def mark(what, unit=None):
        events.append({"op": "mark", "what": what, **({"unit": unit} if unit else {})})

    gather(UNITS[0])
    for i, unit in enumerate(UNITS):
        if unit not in works:
            gather(unit)
        wait(unit)
        if i + 1 < len(UNITS) and not issue_after:
            gather(UNITS[i + 1])
        mark("forward-begins", unit)
        mark("forward-ends", unit)
        if i + 1 < len(UNITS) and issue_after:
            gather(UNITS[i + 1])
    mark("forward-returned")
    pending = []
    for i in reversed(range(len(UNITS))):
        unit = UNITS[i]
        if unit not in works and not (keep_last and i == len(UNITS) - 1):
            gather(unit)
        wait(unit)
        if i > 0 and backward_prefetch:
            gather(UNITS[i - 1])
        mark("backward-begins", unit)
        mark("backward-ends", unit)
        if not rs_in_finish and not rs_late:
            pending.append(issue("all_reduce" if all_reduce else "reduce_scatter_single",
                                 whole[unit] if all_reduce else part[unit]))
            if rs_waited_in_hook:
                events.append({"op": "wait", "id": pending.pop()})
    mark("backward-returned")
    for unit in UNITS if rs_in_finish or rs_late else []:
        pending.append(issue("reduce_scatter_single", part[unit], blocking=rs_in_finish))
    for n in pending:
        events.append({"op": "wait", "id": n})
    mark("finish-returned")
    return events


def order_verdicts(world_size: int = 2, **changes) -> dict:
    g = grading(world_size)
    observations = [{"steps": [{"events": step_events(world_size, **changes)}]} for _ in range(world_size)]
    gathered, sliced = ref.gathered_sizes(world_size), ref.slice_sizes(world_size)
    for check in (v.check_collectives, v.check_forward_prefetch, v.check_backward_prefetch, v.check_reduce_scatters):
        check(g, observations, world_size, gathered, sliced)
    return verdicts(g)


def test_the_references_order_passes_every_order_check_at_every_world_size():
    for world_size in (2, 3, 4):
        got = order_verdicts(world_size)
        assert {k: s for k, (s, _) in got.items()} == {"collectives-per-step": "pass", "prefetch-forward": "pass",
                                                       "prefetch-backward": "pass",
                                                       "reduce-scatter-overlapped": "pass"}, got


def test_the_last_unit_kept_whole_from_its_forward_needs_no_backward_gather():
    assert all(s == "pass" for s, _ in order_verdicts(keep_last=True).values())


def test_waiting_at_once_fails_both_prefetches_and_nothing_else():
    got = order_verdicts(wait_at_once=True)
    assert got["prefetch-forward"][0] == got["prefetch-backward"][0] == "fail"
    assert "waited for before the forward of unit 'embed' ended" in got["prefetch-forward"][1]
    assert got["collectives-per-step"][0] == got["reduce-scatter-overlapped"][0] == "pass"


def test_a_prefetch_issued_after_the_unit_computed_fails():
    status, message = order_verdicts(issue_after=True)["prefetch-forward"]
    assert status == "fail" and "issued after the forward of unit 'embed' had ended" in message


def test_a_blocking_all_gather_fails_as_exposed():
    status, message = order_verdicts(blocking_gather=True)["prefetch-forward"]
    assert status == "fail" and "blocking call" in message


def test_no_prefetch_in_backward_fails_only_the_backward_check():
    got = order_verdicts(backward_prefetch=False)
    assert got["prefetch-backward"][0] == "fail" and got["prefetch-forward"][0] == "pass"
    assert "issued after the backward of unit 'head' had ended" in got["prefetch-backward"][1]


def test_reduce_scatters_in_finish_waited_in_backward_or_issued_late_fail():
    for changes, words in (({"rs_in_finish": True}, "blocking call"),
                           ({"rs_waited_in_hook": True}, "waited for during backward"),
                           ({"rs_late": True}, "issued after backward had returned")):
        status, message = order_verdicts(**changes)["reduce-scatter-overlapped"]
        assert status == "fail" and words in message, (changes, message)


def test_an_all_reduce_of_the_gradients_fails_the_collectives():
    status, message = order_verdicts(all_reduce=True)["collectives-per-step"]
    assert status == "fail" and "all_reduce" in message


def test_a_reduce_scatter_issued_after_the_next_unit_ended_fails():
    events = step_events()
    part = {name: size for size, name in ref.slice_sizes(2).items()}
    issued = next(i for i, e in enumerate(events) if e.get("bytes") == part["hidden"])
    late = events.pop(issued)
    events.insert(next(i for i, e in enumerate(events) if e.get("what") == "backward-ends" and
                       e.get("unit") == "block") + 1, late)
    g = grading()
    v.check_reduce_scatters(g, [{"steps": [{"events": events}]}] * 2, 2, ref.gathered_sizes(2), ref.slice_sizes(2))
    status, message = verdicts(g)["reduce-scatter-overlapped"]
    assert status == "fail" and "only after the backward of unit 'block' had ended" in message


def test_an_unwaited_prefetch_fails():
    events = [e for e in step_events() if not (e["op"] == "wait" and e["id"] == 1)]  # block's forward gather
    g = grading()
    v.check_forward_prefetch(g, [{"steps": [{"events": events}]}] * 2, 2, ref.gathered_sizes(2), ref.slice_sizes(2))
    status, message = verdicts(g)["prefetch-forward"]
    assert status == "fail" and "not waited for before unit 'block'" in message


def test_three_units_in_memory_fail_and_two_pass():
    def probes(found):
        records = [{"phase": "forward", "unit": "embed", "gathered": found},
                   {"phase": "fingerprints", "units": sorted(UNITS)}]
        steps = [{"probes": []}] * rank_side.STEPS
        steps = steps[:rank_side.PROBED_STEP] + [{"probes": records}] + steps[rank_side.PROBED_STEP + 1:]
        return [{"steps": steps}, {"steps": steps}]

    g = grading()
    v.check_probes(g, probes(["embed", "block"]), 2)
    assert verdicts(g)["two-units-at-a-time"][0] == "pass"
    g = grading()
    v.check_probes(g, probes(["embed", "block", "hidden"]), 2)
    status, message = verdicts(g)["two-units-at-a-time"]
    assert status == "fail" and "3 units" in message and "forward of unit 'embed'" in message


def test_the_numbers_name_a_missing_broadcast_and_a_summed_gradient():
    world_size, seed = 2, 3
    reference = ref.reference_steps(seed, world_size)

    def observation(rank, scale=1.0, initial=None):
        steps = []
        for step in reference["steps"]:
            grads = [step["grads"][name][rank] * scale for name in UNITS]
            steps.append({"output": step["outputs"][rank], "grads": grads, "state": step["state"]})
        return {"initial": initial or reference["initial"], "steps": steps}

    g = grading()
    v.check_training(g, [observation(0), observation(1)], reference, world_size)
    assert verdicts(g)["matches-training"][0] == "pass"
    g = grading()
    v.check_training(g, [observation(0, scale=2.0), observation(1, scale=2.0)], reference, world_size)
    status, message = verdicts(g)["matches-training"]
    assert status == "fail" and "2 x the average" in message
    own = {k: t.clone() for k, t in rank_side.build_model(seed, 1).state_dict().items()}
    g = grading()
    v.check_training(g, [observation(0), observation(1, initial=own)], reference, world_size)
    status, message = verdicts(g)["matches-training"]
    assert status == "fail" and "rank 1" in message and "broadcast" in message
