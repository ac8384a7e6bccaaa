"""Exercise 34's layout, replay and verdicts, from hand-made records (no processes started).

Each verdict is shown passing on the record a right answer leaves and failing on a wrong one.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from grader import catalog
from grader.rank.drivers import ex34_pipelining as rank_side
from grader.checks.ex34_pipelining import reference as ref
from grader.checks.ex34_pipelining import verdicts as v
from grader.rank.drivers.shared.stub_models import pipeline_loss
from grading_helpers import grading_for, verdicts

# The orders torch 2.13's schedules run on 2 ranks with 4 micro-batches (as recorded by the rank driver).
TORCH_ORDERS = {
    "GPipe": ["F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3", "F1.0 F1.1 F1.2 F1.3 B1.0 B1.1 B1.2 B1.3"],
    "1F1B": ["F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3", "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3"],
    "Interleaved1F1B": ["F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
                        "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3"],
}
LOOPED_BFS = ["F0.0 F0.1 F0.2 F0.3 F2.0 F2.1 F2.2 F2.3 B2.3 B2.2 B2.1 B2.0 B0.3 B0.2 B0.1 B0.0",
              "F1.0 F1.1 F1.2 F1.3 F3.0 F3.1 F3.2 F3.3 B3.3 B3.2 B3.1 B3.0 B1.3 B1.2 B1.1 B1.0"]


grading = grading_for("34")


@functools.cache
def replay_of(schedule: str, world_size: int) -> dict:
    return ref.reference_run(schedule, world_size)


def actions(order: str) -> list[tuple[str, int, int]]:
    return [(label[0], int(label[1:].split(".")[0]), int(label.split(".")[1])) for label in order.split()]


def peak(acts: list) -> int:
    live, most = set(), 0
    for op, stage, mb in acts:
        (live.add if op == "F" else live.discard)((stage, mb))
        most = max(most, len(live))
    return most


def _events(schedule: str, rank: int, world_size: int, per_step: list[Counter] | None = None) -> list[dict]:
    sends = (per_step or v.expected_sends(schedule, world_size))[rank]
    return [{"op": "isend", "peer": peer, "bytes": size} for (peer, size), n in sorted(sends.items())
            for _ in range(n)]


def records(schedule: str, world_size: int = 2, *, orders=None, states=None, losses=None) -> list[dict]:
    """Every rank's record of one schedule, as a right answer leaves it (the replay's values)."""
    replay = replay_of(schedule, world_size)
    states = replay["states"] if states is None else states
    orders = orders or TORCH_ORDERS[schedule]
    losses = replay["losses"] if losses is None else losses
    num_stages = rank_side.stages_per_rank(schedule) * world_size
    out = []
    for rank in range(world_size):
        mine = rank_side.stages_of_rank(schedule, rank, world_size)
        names = [n for n in replay["initial"] if rank_side.stage_of(n, num_stages, world_size) in mine]
        acts = actions(orders[rank])
        steps = [{"events": _events(schedule, rank, world_size), "actions": acts, "peak_live": peak(acts),
                  "loss": {"type": "float", "value": losses[i]} if rank == world_size - 1 else
                  {"type": "NoneType", "value": None},
                  "params": {f"0/{n}": state[n].clone() for n in names}} for i, state in enumerate(states)]
        out.append({"returned": None, "build_events": [], "held": sorted(names),
                    "stages": [{"index": s, "num_stages": num_stages,
                                "holds": sorted(v.expected_names(schedule, [s], world_size))} for s in mine],
                    "initial": {f"0/{n}": replay["initial"][n].clone() for n in names}, "steps": steps,
                    "error": None})
    return out


def judge(schedule: str, per_rank: list[dict], world_size: int = 2) -> dict:
    g = grading(world_size)
    v.check_schedule(g, schedule, per_rank, world_size, replay_of(schedule, world_size))
    return verdicts(g)


# --- the layout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", rank_side.SCHEDULES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_stages_partition_the_model_and_loop_over_the_ranks(schedule, world_size):
    names = [n for n, _ in rank_side.build_model(schedule, world_size).named_parameters()]
    num_stages = rank_side.stages_per_rank(schedule) * world_size
    per_rank = [rank_side.stages_of_rank(schedule, r, world_size) for r in range(world_size)]
    assert sorted(s for stages in per_rank for s in stages) == list(range(num_stages))
    assert all(s % world_size == r for r, stages in enumerate(per_rank) for s in stages)
    owners = Counter(rank_side.stage_of(n, num_stages, world_size) for n in names)
    assert sorted(owners) == list(range(num_stages))
    assert rank_side.stage_of("tok_embeddings.weight", num_stages, world_size) == 0
    assert rank_side.stage_of("output.weight", num_stages, world_size) == num_stages - 1


def test_an_activation_is_larger_than_any_shape_header():
    assert rank_side.activation_bytes() > v.HEADER_LIMIT


def test_interleaved_on_two_ranks_sends_three_boundaries_worth_each_way():
    m, size = rank_side.n_microbatches(2), rank_side.activation_bytes()
    sends = v.expected_sends("Interleaved1F1B", 2)
    assert sends[0] == Counter({(1, size): 3 * m}) and sends[1] == Counter({(0, size): 3 * m})
    assert v.expected_sends("GPipe", 3)[1] == Counter({(0, size): 6, (2, size): 6})


def test_the_replay_steps_with_the_gradient_of_the_whole_batch_mean_loss():
    model = rank_side.build_model("GPipe", 2)
    tokens, targets = rank_side.make_batch("GPipe", 2, 0)
    pipeline_loss(model(tokens), targets).backward()
    replay = replay_of("GPipe", 2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(replay["states"][0][name], p.detach() - rank_side.LR * p.grad, rtol=1e-10, atol=1e-12)


# --- right records pass ---------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", rank_side.SCHEDULES)
def test_a_right_record_passes_every_check(schedule):
    got = judge(schedule, records(schedule))
    assert {k: s for k, (s, _) in got.items()} == {c.id: "pass" for c in catalog.by_id("34").checks}, got


# --- each wrong one fails its check -----------------------------------------------------------------------


def test_a_rank_that_keeps_other_layers_fails_own_layers():
    per_rank = records("GPipe")
    per_rank[0]["held"] = sorted(set(per_rank[0]["held"]) | {"layers.3.w1.weight", "output.weight"})
    status, message = judge("GPipe", per_rank)["own-layers"]
    assert status == "fail" and "rank 0" in message and "layers.3, output" in message


def test_contiguous_interleaved_stages_fail_the_assignment():
    per_rank = records("Interleaved1F1B")
    per_rank[0]["stages"] = [{"index": i, "num_stages": 4, "holds": sorted(v.expected_names("Interleaved1F1B", [i], 2))}
                             for i in (0, 1)]
    status, message = judge("Interleaved1F1B", per_rank)["stage-assignment"]
    assert status == "fail" and "stage_index 1" in message and "[0, 2]" in message


def test_a_stage_running_another_stages_block_fails_the_assignment():
    per_rank = records("Interleaved1F1B")
    per_rank[0]["stages"][1]["holds"] = sorted(v.expected_names("Interleaved1F1B", [1], 2))
    status, message = judge("Interleaved1F1B", per_rank)["stage-assignment"]
    assert status == "fail" and "stage 2's module holds layers.1" in message


def test_a_send_past_the_neighbours_fails_neighbours_only():
    per_rank = records("GPipe", 2)
    assert judge("GPipe", per_rank)["neighbours-only"][0] == "pass"
    g = grading(3)
    three = [{"build_events": [], "steps": [{"events": []}]} for _ in range(3)]
    three[2]["steps"][0]["events"] = [{"op": "send", "peer": 0, "bytes": 8}]
    v.check_neighbours(g, "GPipe", three, 3)
    status, message = verdicts(g)["neighbours-only"]
    assert status == "fail" and "rank 2 sent to rank 0" in message
    g = grading(3)
    v.check_neighbours(g, "Interleaved1F1B", three, 3)  # stage 2 -> stage 3 goes from rank 2 to rank 0
    assert verdicts(g)["neighbours-only"][0] == "pass"


def test_too_few_micro_batches_fail_messages_per_step():
    per_rank = records("1F1B")
    fewer = [Counter({k: n // 2 for k, n in c.items()}) for c in v.expected_sends("1F1B", 2)]
    for rank, obs in enumerate(per_rank):
        obs["steps"][1]["events"] = _events("1F1B", rank, 2, fewer)
    status, message = judge("1F1B", per_rank)["messages-per-step"]
    assert status == "fail" and "at step 2" in message and f"{rank_side.n_microbatches(2)} x" in message


def test_small_messages_are_not_counted_as_activations():
    per_rank = records("1F1B")
    per_rank[0]["steps"][0]["events"] += [{"op": "isend", "peer": 1, "bytes": 162}]
    assert judge("1F1B", per_rank)["messages-per-step"][0] == "pass"


def test_gpipe_ran_for_1f1b_fails_the_named_schedule():
    status, message = judge("1F1B", records("1F1B", orders=TORCH_ORDERS["GPipe"]))["named-schedule"]
    assert status == "fail" and "4 forwards before its first backward" in message


def test_1f1b_ran_for_gpipe_fails_the_named_schedule():
    status, message = judge("GPipe", records("GPipe", orders=TORCH_ORDERS["1F1B"]))["named-schedule"]
    assert status == "fail" and "GPipe runs all 4 forwards" in message


def test_looped_bfs_ran_for_interleaved_fails_the_named_schedule():
    status, message = judge("Interleaved1F1B", records("Interleaved1F1B", orders=LOOPED_BFS))["named-schedule"]
    assert status == "fail" and "held the activations of 8" in message


def test_a_missing_backward_fails_the_named_schedule():
    orders = [TORCH_ORDERS["GPipe"][0].replace(" B0.3", ""), TORCH_ORDERS["GPipe"][1]]
    status, message = judge("GPipe", records("GPipe", orders=orders))["named-schedule"]
    assert status == "fail" and "3 micro-batch backward" in message


def _scaled_states(schedule: str, factor: float) -> list[dict]:
    replay = replay_of(schedule, 2)
    first = {n: replay["initial"][n] + factor * (replay["states"][0][n] - replay["initial"][n])
             for n in replay["initial"]}
    return [first] + replay["states"][1:]


def test_gradients_n_microbatches_times_too_large_fail_grad_scale():
    got = judge("GPipe", records("GPipe", states=_scaled_states("GPipe", rank_side.n_microbatches(2))))
    status, message = got["grad-scale"]
    assert status == "fail" and "4 times" in message and "scale_grads" in message
    assert got["matches-single-process"][0] == "fail"


def test_gradients_divided_twice_fail_grad_scale():
    status, message = judge("GPipe", records("GPipe", states=_scaled_states("GPipe", 0.25)))["grad-scale"]
    assert status == "fail" and "divided by n_microbatches twice" in message


def test_an_update_in_another_direction_is_left_to_matches_single_process():
    replay = replay_of("GPipe", 2)
    other = {n: t + 0.01 * torch.sin(torch.arange(t.numel(), dtype=t.dtype)).reshape(t.shape)
             for n, t in replay["initial"].items()}
    got = judge("GPipe", records("GPipe", states=[other] + replay["states"][1:]))
    assert got["grad-scale"][0] == "not-checked" and got["matches-single-process"][0] == "fail"


def test_a_rank_whose_optimizer_never_steps_fails_matches_single_process():
    per_rank = records("1F1B")
    for step in per_rank[0]["steps"]:
        step["params"] = {k: t.clone() for k, t in per_rank[0]["initial"].items()}
    got = judge("1F1B", per_rank)
    status, message = got["matches-single-process"]
    assert status == "fail" and "rank 0" in message and "did not change" in message
    assert got["grad-scale"][0] == "pass"  # rank 1's update is right: the scale is not the problem


def test_the_sum_of_the_losses_fails_loss_returned():
    replay = replay_of("GPipe", 2)
    m = rank_side.n_microbatches(2)
    status, message = judge("GPipe", records("GPipe", losses=[m * x for x in replay["losses"]]))["loss-returned"]
    assert status == "fail" and "summed, not averaged" in message


def test_a_loss_on_the_first_rank_fails_loss_returned():
    per_rank = records("GPipe")
    per_rank[0]["steps"][0]["loss"] = {"type": "float", "value": 1.0}
    status, message = judge("GPipe", per_rank)["loss-returned"]
    assert status == "fail" and "rank 0 returned a float" in message


def test_an_error_in_training_fails_matches_single_process_and_leaves_the_rest_unchecked():
    per_rank = records("1F1B")
    per_rank[0]["error"] = "RuntimeError: Connection closed by peer"
    per_rank[1]["error"] = "AssertionError: stage 1 (raised at schedules.py:100)"
    for obs in per_rank:
        obs["steps"] = []
    got = judge("1F1B", per_rank)
    status, message = got["matches-single-process"]
    assert status == "fail" and "rank 1" in message and "AssertionError" in message
    assert all(got[c][0] == "not-checked" for c in v.TRAINING_CHECKS)
    assert got["own-layers"][0] == "pass" and got["stage-assignment"][0] == "pass"


def test_a_rank_that_runs_nothing_is_named_when_its_neighbours_fail():
    per_rank = records("GPipe")
    per_rank[0]["error"] = "RuntimeError: Connection closed by peer"
    per_rank[0]["steps"] = []
    for step in per_rank[1]["steps"]:
        step["actions"] = []
    status, message = judge("GPipe", per_rank)["matches-single-process"]
    assert status == "fail" and "rank(s) [1] returned from train_step without running their stages" in message
