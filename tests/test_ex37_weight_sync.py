"""Exercise 37's verdicts, from hand-made records (no processes started), and the grader's own arithmetic of
the two layouts."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from grading_helpers import grading_for
from grading_helpers import verdicts as decided

from grader.rank.drivers import ex37_weight_sync as ex_rank
from grader.checks.ex37_weight_sync import reference, verdicts
from grader.checks.shared import mismatch
from grader.rank.drivers.shared.recording import MessageJournal
from grader.grading import Grading
from grader.rank.outcomes import RankOutcome, WorldOutcome

grading = grading_for("37")


def statuses(g: Grading) -> dict:
    return {check: status for check, (status, _) in decided(g).items()}


def messages(g: Grading) -> dict:
    return {check: message for check, (_, message) in decided(g).items()}


def send(nbytes: int, peer: int, op: str = "send") -> dict:
    return {"op": op, "bytes": nbytes, "peer": peer, "group": None, "dtype": "float32"}


def right_push(world_size: int, split_index: int, scenario: str, rank: int) -> dict:
    """One rank's record of a push as a right answer leaves it: a trainer rank's sends (one message per
    inference rank, the overlap's bytes), an inference rank's receives and slices, nothing held whole."""
    split = ex_rank.splits(world_size)[split_index]
    pairs = reference.pair_bytes(world_size, split_index, scenario)
    record = {"split": split_index, "scenario": scenario, "events": [], "held": {}, "looks": 9, "error": None}
    if rank in split["trainers"]:
        record.update(role="trainer", returned={"kind": "none"})
        record["events"] = [send(pairs[(rank, i)], i) for i in split["inference"] if pairs[(rank, i)]]
    else:
        slices = reference.expected(world_size, split_index, scenario)[rank]
        record.update(role="inference", returned={"kind": "dict", "count": len(slices),
                                                  "entries": {k: v.clone() for k, v in slices.items()}})
        record["events"] = [send(pairs[(t, rank)], t, "recv_") for t in split["trainers"] if pairs[(t, rank)]]
    return record


@functools.cache
def _right(world_size: int) -> list[dict]:
    keys = [(s, scenario) for s in range(len(ex_rank.splits(world_size))) for scenario in ex_rank.SCENARIOS]
    return [{"pushes": [right_push(world_size, s, scenario, rank) for s, scenario in keys]}
            for rank in range(world_size)]


def right(world_size: int) -> list[dict]:
    return copy.deepcopy(_right(world_size))


def push_of(observations: list, rank: int, split_index: int, scenario: str) -> dict:
    return next(p for p in observations[rank]["pushes"] if (p["split"], p["scenario"]) == (split_index, scenario))


def grade_all(observations: list, world_size: int) -> Grading:
    g = grading(world_size)
    verdicts.check_returns(g, observations, world_size)
    verdicts.check_shards(g, observations, world_size)
    clean = verdicts.check_messages(g, observations, world_size)
    verdicts.check_bytes(g, observations, world_size, clean)
    verdicts.check_held(g, observations, world_size)
    return g


# --- the grader's arithmetic ---------------------------------------------------------------------------


def test_the_splits_put_trainers_first_and_in_an_odd_world_last_too():
    assert ex_rank.splits(1) == []
    assert [(s["trainers"], s["inference"]) for s in ex_rank.splits(4)] == [([0, 1], [2, 3])]
    assert [(s["trainers"], s["inference"]) for s in ex_rank.splits(3)] == [([0], [1, 2]), ([1, 2], [0])]
    for world_size in range(2, 10):
        for split in ex_rank.splits(world_size):
            assert sorted(split["trainers"] + split["inference"]) == list(range(world_size))
            assert split["trainers"] and split["inference"]


def test_the_trainer_rows_are_torch_chunks_cut():
    for n in range(1, 15):
        for parts in range(1, 6):
            chunks = torch.arange(n).chunk(parts)
            for k in range(parts):
                start, stop = ex_rank.trainer_rows(n, parts, k)
                got = list(range(start, stop))
                assert got == (chunks[k].tolist() if k < len(chunks) else []), (n, parts, k)


def test_every_split_dimension_divides_by_the_inference_ranks():
    for inference in range(1, 9):
        shapes = ex_rank.shapes(inference)
        for layout in ex_rank.LAYOUTS.values():
            for name, shape in shapes.items():
                dim = reference.split_dim(name, layout)
                assert dim is None or shape[dim] % inference == 0, (inference, name)


def test_the_pairs_bytes_add_up_to_what_the_inference_layout_holds():
    for world_size in (2, 3, 4, 5, 8):
        for s, split in enumerate(ex_rank.splits(world_size)):
            for scenario in ex_rank.SCENARIOS:
                held = sum(t.numel() * t.element_size()
                           for slices in reference.expected(world_size, s, scenario).values() for t in slices.values())
                assert reference.layout_bytes(world_size, s, scenario) == held


def test_the_slices_follow_the_layout():
    slices = reference.expected(4, 0, "a")
    full = ex_rank.weights("a", 0, 2)
    assert torch.equal(slices[3]["blocks.0.up.weight"], full["blocks.0.up.weight"][6:])  # colwise: rows
    assert torch.equal(slices[3]["blocks.0.down.weight"], full["blocks.0.down.weight"][:, 6:])  # rowwise: columns
    assert torch.equal(slices[3]["blocks.0.down.bias"], full["blocks.0.down.bias"])  # a rowwise bias: whole
    assert torch.equal(slices[2]["inp.weight"], full["inp.weight"])  # not in the layout: replicated
    assert slices[2]["inp.weight"].dtype == torch.float32 and reference.expected(4, 0, "b")[2]["inp.weight"].dtype \
        == torch.float64


def test_what_a_rank_keeps_whole():
    assert reference.kept_names(4, 0, "a", 0) == set()  # one of two trainer ranks
    assert reference.kept_names(3, 0, "a", 0) == set(ex_rank.shapes(2))  # the only trainer rank
    assert reference.kept_names(3, 1, "a", 0) == set(ex_rank.shapes(1))  # the only inference rank
    replicated = reference.kept_names(4, 0, "a", 2)
    assert "inp.weight" in replicated and "blocks.0.down.bias" in replicated
    assert "blocks.0.up.weight" not in replicated and "blocks.0.down.weight" not in replicated


# --- verdicts -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_right_answer_passes_every_check(world_size):
    got = statuses(grade_all(right(world_size), world_size))
    want = {"returns-shards", "shards-match", "layout-honoured", "slice-bytes", "trainer-to-inference-only",
            "holds-no-whole"} | ({"rank-lists"} if world_size == 3 else set())
    assert got == {check: "pass" for check in want}


def test_a_trainer_rank_that_returns_its_shards_fails_returns_shards():
    obs = right(4)
    push_of(obs, 1, 0, "b")["returned"] = {"kind": "dict", "entries": {}, "count": 0}
    g = grade_all(obs, 4)
    assert statuses(g)["returns-shards"] == "fail" and statuses(g)["shards-match"] == "pass"
    said = messages(g)["returns-shards"]
    assert "trainer rank 1 (the 2nd of 2): it returned a dict; a trainer rank returns None" in said


@pytest.mark.parametrize("change, words", [
    (lambda e: e.pop("out.bias"), "it lacks out.bias"),
    (lambda e: e.__setitem__("extra", torch.zeros(1)), "keys the model does not: extra"),
    (lambda e: e.__setitem__("inp.weight", e["inp.weight"].double()),
     "inp.weight is float64; the parameter is float32"),
    (lambda e: e.__setitem__("inp.bias", "a tensor on the meta device"), "inp.bias is a tensor on the meta device"),
])
def test_an_inference_ranks_dict_is_checked_before_its_values(change, words):
    obs = right(4)
    change(push_of(obs, 3, 0, "a")["returned"]["entries"])
    g = grade_all(obs, 4)
    assert statuses(g)["returns-shards"] == "fail" and words in messages(g)["returns-shards"]
    assert statuses(g)["shards-match"] == "not-checked"


def test_another_ranks_slice_is_named():
    obs = right(4)
    a, b = push_of(obs, 2, 0, "a")["returned"]["entries"], push_of(obs, 3, 0, "a")["returned"]["entries"]
    a["blocks.1.down.weight"], b["blocks.1.down.weight"] = b["blocks.1.down.weight"], a["blocks.1.down.weight"]
    g = grade_all(obs, 4)
    assert statuses(g)["shards-match"] == "fail" and statuses(g)["layout-honoured"] == "pass"
    said = messages(g)["shards-match"]
    assert "inference rank 2 (the 1st of 2)" in said and "it is the slice inference rank 3 (the 2nd of 2) keeps" in said


def test_a_slice_of_the_wrong_shape_says_what_the_rank_keeps():
    obs = right(4)
    entries = push_of(obs, 2, 0, "b")["returned"]["entries"]
    entries["inp.weight"] = ex_rank.weights("b", 0, 2)["inp.weight"]  # whole, where layout b splits its columns
    g = grade_all(obs, 4)
    assert statuses(g)["layout-honoured"] == "fail" and statuses(g)["shards-match"] == "pass"
    assert "inp.weight has shape [7, 6]; this rank keeps [7, 3] of its [7, 6] (rowwise: split along dim 1)" in \
        messages(g)["layout-honoured"]


def test_rows_from_the_wrong_place_are_named():
    obs = right(4)
    entries = push_of(obs, 2, 0, "a")["returned"]["entries"]
    full = ex_rank.weights("a", 0, 2)["inp.weight"]
    entries["inp.weight"] = torch.cat([full[:3], full[4:], full[3:4]])  # rows 3-6 shifted by one
    said = messages(grade_all(obs, 4))["shards-match"]
    assert "its row 3 (of rows 3, 4, 5, 6 that differ) holds the trainer's row 4 of inp.weight" in said


def test_a_zero_row_says_nothing_arrived():
    obs = right(4)
    push_of(obs, 3, 0, "a")["returned"]["entries"]["out.weight"][1].zero_()
    assert "its row 1 (of rows 1 that differ) is all zeros: nothing was received there" in \
        messages(grade_all(obs, 4))["shards-match"]


def test_the_reversed_split_decides_rank_lists_alone():
    obs = right(3)
    push_of(obs, 0, 1, "b")["returned"]["entries"]["blocks.0.up.weight"] += 1
    got = statuses(grade_all(obs, 3))
    assert got["rank-lists"] == "fail" and got["shards-match"] == "pass" and got["layout-honoured"] == "pass"


def test_a_push_that_raised_fails_its_check_and_the_later_ones_are_not_checked():
    obs = right(3)
    for rank in range(3):
        pushes = obs[rank]["pushes"]
        obs[rank]["pushes"] = pushes[:2]  # the reversed split never ran
    push_of(obs, 1, 0, "b").update(error="RuntimeError: Timed out waiting 5000ms for recv operation", returned=None)
    g = grade_all(obs, 3)
    got, said = statuses(g), messages(g)
    assert got["layout-honoured"] == "fail" and "push_weights raised RuntimeError: Timed out" in said["layout-honoured"]
    assert got["rank-lists"] == "not-checked" and got["shards-match"] == "pass" and got["returns-shards"] == "pass"


def test_only_pushes_that_raised_leave_returns_shards_undecided():
    obs = right(4)
    for rank in range(4):
        obs[rank]["pushes"] = obs[rank]["pushes"][:1]
        obs[rank]["pushes"][0].update(error="ValueError: no", returned=None)
    g = grade_all(obs, 4)
    assert statuses(g)["returns-shards"] == "not-checked" and statuses(g)["shards-match"] == "fail"


@pytest.mark.parametrize("rank, event, words", [
    (0, send(16, 1), "trainer rank 0 (the 1st of 2): it sent 16 bytes to trainer rank 1 (the 2nd of 2)"),
    (2, send(4, 0), "inference rank 2 (the 1st of 2): it sent 4 bytes to trainer rank 0"),
    (2, send(8, 3, "recv_"), "it received 8 bytes from inference rank 3 (the 2nd of 2)"),
    (1, send(8, 2, "recv_"), "trainer rank 1 (the 2nd of 2): it received 8 bytes from inference rank 2"),
    (0, {"op": "allgather_", "bytes": 96, "peer": None, "group": [0, 1]},
     "it ran a collective, allgather_ of 96 bytes among ranks [0, 1]"),
])
def test_a_message_that_is_not_a_trainers_send_to_an_inference_rank_fails(rank, event, words):
    obs = right(4)
    push_of(obs, rank, 0, "a")["events"].append(event)
    g = grade_all(obs, 4)
    assert statuses(g)["trainer-to-inference-only"] == "fail" and words in messages(g)["trainer-to-inference-only"]
    assert statuses(g)["slice-bytes"] == "pass"  # judged on layout b, whose messages were clean


def test_an_empty_receive_from_any_source_is_allowed():
    obs = right(4)
    push_of(obs, 2, 0, "a")["events"] += [send(0, None, "recv_any_source_"), send(0, 3)]
    assert statuses(grade_all(obs, 4))["trainer-to-inference-only"] == "pass"


def test_a_barrier_fails_whatever_it_carries():
    """A barrier is a collective (the statement allows none); the grader's own agreement between pushes runs
    outside the watch, so any barrier recorded is the learner's."""
    for op, size in (("barrier", 1), ("monitored_barrier_", 0)):
        obs = right(4)
        push_of(obs, 1, 0, "a")["events"].append({"op": op, "bytes": size, "peer": None, "group": [0, 1, 2, 3]})
        g = grade_all(obs, 4)
        said = messages(g)["trainer-to-inference-only"]
        assert statuses(g)["trainer-to-inference-only"] == "fail" and "trainer rank 1" in said
        assert f"it ran a collective, {op} of {size} bytes among ranks [0, 1, 2, 3]: a barrier is a collective" in said


def test_bytes_are_judged_per_pair():
    obs = right(4)
    push_of(obs, 0, 0, "a")["events"].append(send(880, 2))  # the slice sent twice
    g = grade_all(obs, 4)
    assert statuses(g)["slice-bytes"] == "fail"
    said = messages(g)["slice-bytes"]
    assert "trainer rank 0 (the 1st of 2) sent inference rank 2 (the 1st of 2) 1760 bytes in 2 message(s)" in said
    assert "the rows it holds of what that rank keeps are 880 bytes, more" in said and "In all 3240 bytes" in said


def test_too_few_bytes_fail_too():
    obs = right(3)
    push_of(obs, 2, 1, "b")["events"][0]["bytes"] -= 8
    g = grade_all(obs, 3)
    assert statuses(g)["slice-bytes"] == "fail" and ", less:" in messages(g)["slice-bytes"]


def test_bytes_are_not_counted_where_other_messages_carried_data():
    obs = right(4)
    for rank in range(4):
        for push in obs[rank]["pushes"]:
            push["events"].append({"op": "broadcast_", "bytes": 64, "peer": None, "group": [0, 1, 2, 3]})
    g = grade_all(obs, 4)
    assert statuses(g)["slice-bytes"] == "not-checked" and statuses(g)["trainer-to-inference-only"] == "fail"


def test_holding_a_parameter_whole_fails_only_where_the_rank_does_not_keep_it():
    obs = right(4)
    push_of(obs, 2, 0, "a")["held"] = {"inp.weight": "after a receive"}  # replicated: kept whole
    assert statuses(grade_all(obs, 4))["holds-no-whole"] == "pass"
    push_of(obs, 1, 0, "b")["held"] = {"blocks.0.up.weight": "after an all-gather"}
    g = grade_all(obs, 4)
    assert statuses(g)["holds-no-whole"] == "fail"
    assert "trainer rank 1 (the 2nd of 2) held blocks.0.up.weight whole, after an all-gather" in \
        messages(g)["holds-no-whole"]


def test_the_only_trainer_and_the_only_inference_rank_keep_everything():
    obs = right(3)
    push_of(obs, 0, 0, "a")["held"] = {name: "when push_weights returned" for name in ex_rank.shapes(2)}
    push_of(obs, 0, 1, "a")["held"] = {name: "after a receive" for name in ex_rank.shapes(1)}
    assert statuses(grade_all(obs, 3))["holds-no-whole"] == "pass"


@pytest.mark.parametrize("breakage, check", [
    (lambda obs: obs.__setitem__(0, "a string"), "shards-match"),
    (lambda obs: obs[0].__setitem__("pushes", [1, None, "x"]), "shards-match"),
    (lambda obs: push_of(obs, 2, 0, "a").__setitem__("events", [{"op": 3}]), "trainer-to-inference-only"),
    (lambda obs: push_of(obs, 2, 0, "a").__setitem__("returned", {"kind": "dict", "entries": [1, 2]}),
     "returns-shards"),
    (lambda obs: push_of(obs, 3, 0, "a")["returned"]["entries"].__setitem__("inp.weight", torch.zeros(2, 2, 2)),
     "shards-match"),
])
def test_a_malformed_record_fails_its_check_without_raising(breakage, check):
    obs = right(4)
    breakage(obs)
    assert statuses(grade_all(obs, 4))[check] == "fail"


def test_names_the_model_does_not_have_are_not_held_parameters():
    obs = right(4)
    push_of(obs, 1, 0, "a")["held"] = {"x": "after a receive", 2: "y"}
    assert statuses(grade_all(obs, 4))["holds-no-whole"] == "pass"


def test_a_push_whose_receive_met_a_message_of_another_size_is_named(tmp_path):
    """An inference rank receiving a slice of another shape than the trainer sends is aborted by gloo, its record
    lost: the notes each rank wrote before each message name the pair that differed, and in which push."""
    pushed = "push_weights: trainers 0, 1, layout a"
    for rank, notes in ((2, [("recv_", 0, torch.zeros(3, 7), None)]),
                        (0, [("send", 2, torch.zeros(4, 7), "its rows of blocks.0.up.weight")])):
        book = MessageJournal(str(tmp_path), rank)
        for op, peer, tensor, what in notes:
            book.message(op, peer, ([tensor], None, peer, 0), pushed, lambda t, what=what: what)
        book.close()
    gloo = ("what():  [enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 112 vs 84. "
            "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?")
    ranks = [RankOutcome(0, "killed"), RankOutcome(1, "killed"), RankOutcome(2, "exited", exitcode=-6, output=gloo),
             RankOutcome(3, "killed")]
    rank, said = mismatch.explain(WorldOutcome(4, ranks, run_dir=str(tmp_path)))
    assert rank == 2 and said.startswith(f"{pushed}: rank 2's 1st receive from rank 0 (84 bytes: float32 [3, 7]) met "
                                         "rank 0's 1st send to it (112 bytes: float32 [4, 7], its rows of "
                                         "blocks.0.up.weight)")
