"""Exercise 20's verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import torch

from grader.rank.drivers import ex20_ulysses as ex_rank
from grader.checks.ex20_ulysses import reference, verdicts
from grader.grading import Grading
from grader.rank.harness import RankOutcome, WorldOutcome
from grading_helpers import grading_for

SCENARIOS = ("plain", "causal", "gqa", "few-kv")


grading = grading_for("20")


def statuses(g: Grading) -> dict:
    return {c.id: c.status for c in g.results(None) if c.status != "error"}


def messages(g: Grading) -> dict:
    return {c.id: c.message for c in g.results(None)}


def exchange(heads: int, members: list[int]) -> dict:
    """One all-to-all of a rank's chunk of a tensor of ``heads`` heads, keeping its own 1/W part."""
    total = reference.local_bytes(heads)
    kept = total // len(members)
    return {"op": "c10d.alltoall_base_.default", "bytes": total, "group": list(members), "kept": kept,
            "sent": total - kept, "dtype": "float64"}


def right_events(scenario: str, members: list[int]) -> list[dict]:
    heads, kv_heads, _ = ex_rank.shapes(scenario, len(members))
    copies = ex_rank.replication(kv_heads, len(members))
    return [exchange(heads, members), exchange(kv_heads * copies, members), exchange(kv_heads * copies, members),
            exchange(heads, members)]


def right_run(scenario: str, rank: int, members: list[int]) -> dict:
    size, me = len(members), members.index(rank)
    want = reference.expected(scenario, size)
    heads, kv_heads, _ = ex_rank.shapes(scenario, size)
    share = ex_rank.heads_share(kv_heads, heads, size)
    return {
        "output": want["output"][:, :, ex_rank.positions(me, size)].clone(),
        "grads": {name: want[name][:, :, ex_rank.positions(me, size)].clone() for name in ("q", "k", "v")},
        "backward_ran": True,
        "forward_events": right_events(scenario, members),
        "backward_events": right_events(scenario, members),
        "held": {"most": {name: list(range(share[name])) for name in share}, "where": {}, "probes": 9},
    }


def right_observations(world_size: int) -> list[dict]:
    everyone = list(range(world_size))
    observations = []
    for rank in range(world_size):
        obs = {scenario: right_run(scenario, rank, everyone) for scenario in SCENARIOS}
        members = next(m for m in ex_rank.groups_of(world_size) if rank in m)
        obs["group"] = right_run("group", rank, members)
        obs["group"]["members"] = members
        observations.append(obs)
    return observations


def grade_all(observations: list[dict], world_size: int) -> Grading:
    g = grading(world_size)
    verdicts.check_outputs(g, observations, world_size)
    verdicts.check_gradients(g, observations, world_size)
    verdicts.check_gqa(g, observations, world_size)
    verdicts.check_messages(g, observations, world_size)
    verdicts.check_held(g, observations, world_size)
    verdicts.check_group(g, observations, world_size)
    return g


def test_right_records_pass_every_check():
    for world_size in (2, 3, 4):
        got = statuses(grade_all(right_observations(world_size), world_size))
        assert set(got.values()) == {"pass"}, (world_size, got)
        assert len(got) == 9


def test_a_fused_exchange_of_q_k_and_v_is_the_method_too():
    observations = right_observations(2)
    for obs in observations:
        for scenario in SCENARIOS:
            events = obs[scenario]["forward_events"]
            fused = {"op": "_c10d_functional.all_to_all_single.default", "group": [0, 1], "dtype": "float64",
                     "bytes": sum(e["bytes"] for e in events[:3]), "kept": sum(e["kept"] for e in events[:3]),
                     "sent": sum(e["sent"] for e in events[:3])}
            obs[scenario]["forward_events"] = [fused, events[3]]
    assert statuses(grade_all(observations, 2))["only-all-to-alls"] == "pass"
    assert statuses(grade_all(observations, 2))["bytes-off-rank"] == "pass"


def test_heads_in_another_order_are_named():
    observations = right_observations(2)
    out = observations[1]["plain"]["output"]
    observations[1]["plain"]["output"] = out[:, [0, 2, 1, 3]].clone()
    g = grade_all(observations, 2)
    assert statuses(g)["matches-attention"] == "fail"
    said = messages(g)["matches-attention"]
    assert "rank 1" in said and "heads 0-3 hold heads [0, 2, 1, 3]" in said


def test_attention_over_the_own_chunk_alone_is_named():
    observations = right_observations(2)
    data = ex_rank.make_inputs("plain", 2)
    own = [data[name][:, :, ex_rank.positions(0, 2)] for name in ("q", "k", "v")]
    observations[0]["plain"]["output"] = reference.attention(*own)
    g = grade_all(observations, 2)
    assert "this rank's own chunk alone" in messages(g)["matches-attention"]


def test_a_causal_output_wrong_where_the_plain_one_is_right_points_at_the_order_of_the_sequence():
    observations = right_observations(2)
    data = ex_rank.make_inputs("causal", 2)
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # position-major: the chunks interleaved
    shuffled = reference.attention(*(data[name][:, :, order] for name in ("q", "k", "v")), causal=True)
    back = torch.empty_like(shuffled)
    back[:, :, order] = shuffled
    observations[1]["causal"]["output"] = back[:, :, ex_rank.positions(1, 2)]
    g = grade_all(observations, 2)
    got = statuses(g)
    assert got["causal-matches"] == "fail" and got["matches-attention"] == "pass"
    assert "not in position order" in messages(g)["causal-matches"]


def test_an_output_without_autograd_fails_the_gradients_and_says_why():
    observations = right_observations(3)
    run = observations[2]["plain"]
    run["backward_ran"], run["grads"] = False, {"q": None, "k": None, "v": None}
    g = grade_all(observations, 3)
    assert statuses(g)["grads-match"] == "fail"
    said = messages(g)["grads-match"]
    assert "rank 2" in said and "no backward could be run" in said and "backward of their own" in said


def test_a_wrong_key_grad_is_named_with_its_index():
    observations = right_observations(2)
    observations[0]["causal"]["grads"]["k"][1, 3, 2, 5] += 0.5
    g = grade_all(observations, 2)
    said = messages(g)["causal-grads-match"]
    assert statuses(g)["causal-grads-match"] == "fail" and "'k.grad'" in said and "[1, 3, 2, 5]" in said


def test_gqa_pairing_of_query_and_key_value_heads_is_named():
    world_size = 4
    observations = right_observations(world_size)
    data = ex_rank.make_inputs("few-kv", world_size)
    heads, kv_heads, _ = ex_rank.shapes("few-kv", world_size)
    paired = [(h // (heads // world_size)) % kv_heads for h in range(heads)]  # k.repeat instead of repeat_interleave
    out = torch.cat([reference.attention(data["q"][:, h:h + 1], data["k"][:, j:j + 1], data["v"][:, j:j + 1])
                     for h, j in enumerate(paired)], dim=1)
    observations[0]["few-kv"]["output"] = out[:, :, ex_rank.positions(0, world_size)]
    g = grade_all(observations, world_size)
    said = messages(g)["gqa-matches"]
    assert statuses(g)["gqa-matches"] == "fail"
    assert f"key/value heads {paired}" in said and "[0, 0, 0, 0, 1, 1, 1, 1]" in said


def test_key_value_heads_tiled_on_each_rank_are_named():
    """Two key/value heads per rank: k.repeat on the rank's own heads pairs its query head i with its key/value
    head i % 2 instead of i // 2."""
    world_size = 2
    observations = right_observations(world_size)
    data = ex_rank.make_inputs("gqa", world_size)
    heads, kv_heads, _ = ex_rank.shapes("gqa", world_size)
    per_rank, kv_per_rank = heads // world_size, kv_heads // world_size
    paired = [kv_per_rank * (h // per_rank) + (h % per_rank) % kv_per_rank for h in range(heads)]
    right = [h // (heads // kv_heads) for h in range(heads)]
    assert paired != right
    out = torch.cat([reference.attention(data["q"][:, h:h + 1], data["k"][:, j:j + 1], data["v"][:, j:j + 1])
                     for h, j in enumerate(paired)], dim=1)
    observations[1]["gqa"]["output"] = out[:, :, ex_rank.positions(1, world_size)]
    g = grade_all(observations, world_size)
    said = messages(g)["gqa-matches"]
    assert statuses(g)["gqa-matches"] == "fail" and "rank 1" in said
    assert f"key/value heads {paired}" in said and str(right) in said


def test_a_causal_mask_cut_per_chunk_is_named():
    observations = right_observations(2)
    data = ex_rank.make_inputs("causal", 2)
    own = [data[name][:, :, ex_rank.positions(1, 2)] for name in ("q", "k", "v")]
    observations[1]["causal"]["output"] = reference.attention(*own, causal=True)
    g = grade_all(observations, 2)
    said = messages(g)["causal-matches"]
    assert statuses(g)["causal-matches"] == "fail" and statuses(g)["matches-attention"] == "pass"
    assert "every key arrived" in said and "a causal mask cut per chunk" in said
    assert "never arrived" not in said


def test_wrong_attention_between_right_exchanges_is_named():
    data = ex_rank.make_inputs("plain", 2)
    q, k, v = (data[name] for name in ("q", "k", "v"))
    for wrong, words in ((reference.attention(q, k, v, scale=1 / q.shape[-1]), "scaled twice"),
                         (reference.attention(q, k, v, over=-2), "the softmax taken over the queries")):
        observations = right_observations(2)
        observations[0]["plain"]["output"] = wrong[:, :, ex_rank.positions(0, 2)]
        said = messages(grade_all(observations, 2))["matches-attention"]
        assert words in said and "the attention between them is what differs" in said
        assert "another order" not in said


def test_wrong_attention_is_named_in_grouped_query_attention_and_in_a_group():
    """Attention scaled twice fails gqa-matches and uses-group too, and each names it (they said only how far the
    output was)."""
    observations = right_observations(4)
    for scenario, rank, size, me in (("gqa", 1, 4, 1), ("group", 2, 2, 1)):  # rank 2 is rank 1 of group [0, 2]
        data = ex_rank.make_inputs(scenario, size)
        wrong = reference.attention(data["q"], data["k"], data["v"], scale=1 / data["q"].shape[-1])
        observations[rank][scenario]["output"] = wrong[:, :, ex_rank.positions(me, size)]
    g = grade_all(observations, 4)
    said = messages(g)
    assert statuses(g)["matches-attention"] == "pass"
    for check_id, where in (("gqa-matches", "rank 1"), ("uses-group", "rank 2 in group=[0, 2]")):
        assert statuses(g)[check_id] == "fail" and where in said[check_id], said[check_id]
        assert "scaled twice" in said[check_id] and "the attention between them is what differs" in said[check_id]


def test_a_refusal_of_grouped_query_attention_fails_it():
    observations = right_observations(2)
    for obs in observations:
        obs["few-kv"] = {"error": "ValueError: 1 key/value heads cannot be split over 2 ranks"}
    g = grade_all(observations, 2)
    assert statuses(g)["gqa-matches"] == "fail" and "raised ValueError" in messages(g)["gqa-matches"]


def test_an_all_gather_fails_only_all_to_alls_and_leaves_the_bytes_undecided():
    observations = right_observations(2)
    for obs in observations:
        for scenario in SCENARIOS:
            for phase in ("forward_events", "backward_events"):
                obs[scenario][phase] = [{"op": "_c10d_functional.all_gather_into_tensor.default", "bytes": 2048,
                                         "group": [0, 1], "kept": None, "sent": None}]
    g = grade_all(observations, 2)
    got = statuses(g)
    assert got["only-all-to-alls"] == "fail" and got["bytes-off-rank"] == "not-checked"
    assert "all_gather_into_tensor of 2048 bytes" in messages(g)["only-all-to-alls"]


def test_a_few_numbers_in_another_collective_are_allowed():
    observations = right_observations(2)
    observations[0]["plain"]["forward_events"].insert(
        0, {"op": "c10d.allreduce_.default", "bytes": 16, "group": [0, 1], "kept": None, "sent": None})
    assert statuses(grade_all(observations, 2))["only-all-to-alls"] == "pass"


def test_the_exchange_redone_in_backward_fails_the_count_and_the_bytes():
    observations = right_observations(2)
    run = observations[1]["gqa"]
    run["backward_events"] = right_events("gqa", [0, 1]) + right_events("gqa", [0, 1])[:3]
    g = grade_all(observations, 2)
    got = statuses(g)
    assert got["only-all-to-alls"] == "fail" and "7 all-to-all(s)" in messages(g)["only-all-to-alls"]
    assert got["bytes-off-rank"] == "fail" and "backward" in messages(g)["bytes-off-rank"]


def test_an_exchange_that_keeps_more_than_its_own_part_is_named():
    observations = right_observations(4)
    event = observations[3]["plain"]["forward_events"][0]
    event["kept"], event["sent"] = event["bytes"] // 2, event["bytes"] - event["bytes"] // 2
    g = grade_all(observations, 4)
    said = messages(g)["bytes-off-rank"]
    assert statuses(g)["bytes-off-rank"] == "fail" and "rank 3" in said and "1/4" in said


def test_key_value_heads_sent_for_every_query_head_are_too_many_bytes():
    observations = right_observations(2)
    heads = ex_rank.shapes("gqa", 2)[0]
    for obs in observations:
        events = obs["gqa"]["forward_events"]
        events[1], events[2] = exchange(heads, [0, 1]), exchange(heads, [0, 1])
    g = grade_all(observations, 2)
    said = messages(g)["bytes-off-rank"]
    assert statuses(g)["bytes-off-rank"] == "fail"
    assert str(reference.bytes_to_send("gqa", 2)) in said and "1.33 times" in said


def test_records_that_are_not_events_fail_without_an_exception():
    observations = right_observations(2)
    observations[0]["plain"]["forward_events"] = "plenty"
    observations[1]["causal"]["forward_events"] = [{"op": "x", "bytes": -5}]
    g = grade_all(observations, 2)
    assert statuses(g)["only-all-to-alls"] == "fail" and statuses(g)["bytes-off-rank"] == "not-checked"
    bad_bytes = right_observations(2)
    bad_bytes[1]["plain"]["backward_events"][0]["kept"] = "half"
    assert statuses(grade_all(bad_bytes, 2))["only-all-to-alls"] == "fail"


def test_holding_more_heads_whole_than_the_share_fails():
    observations = right_observations(2)
    observations[1]["plain"]["held"] = {"most": {"q": [0, 1, 2, 3], "k": [0, 1], "v": [0, 1]},
                                        "where": {"q": "in forward, after the collective allgather_"}}
    g = grade_all(observations, 2)
    said = messages(g)["heads-share-held"]
    assert statuses(g)["heads-share-held"] == "fail"
    assert "rank 1" in said and "4 heads of q" in said and "after the collective allgather_" in said
    assert "its share is 2" in said


def test_one_key_value_head_per_rank_is_the_share_with_fewer_than_w():
    observations = right_observations(4)
    assert ex_rank.heads_share(2, 8, 4) == {"q": 2, "k": 1, "v": 1}
    observations[0]["few-kv"]["held"]["most"]["k"] = [0, 1]
    g = grade_all(observations, 4)
    assert statuses(g)["heads-share-held"] == "fail" and "2 heads of k" in messages(g)["heads-share-held"]


def test_a_missing_record_of_what_was_held_fails():
    observations = right_observations(2)
    observations[0]["gqa"]["held"] = None
    assert statuses(grade_all(observations, 2))["heads-share-held"] == "fail"


def test_collectives_outside_the_group_fail_uses_group():
    observations = right_observations(4)
    observations[2]["group"]["forward_events"][0]["group"] = [0, 1, 2, 3]
    g = grade_all(observations, 4)
    said = messages(g)["uses-group"]
    assert statuses(g)["uses-group"] == "fail" and "among ranks [0, 1, 2, 3]" in said and "rank 2" in said


def test_a_group_record_that_names_no_group_fails():
    observations = right_observations(3)
    observations[1]["group"]["members"] = [0, 1, 2]
    assert statuses(grade_all(observations, 3))["uses-group"] == "fail"


def test_outputs_that_are_not_tensors_or_hold_nan_fail():
    observations = right_observations(2)
    observations[0]["plain"]["output"] = "a list"
    bad = observations[1]["causal"]["output"]
    bad[0, 0, 0, 0] = float("nan")
    got = statuses(grade_all(observations, 2))
    assert got["matches-attention"] == "fail" and got["causal-matches"] == "fail"


# --- refusals ---------------------------------------------------------------------------------


def outcome(world_size: int, results: list, statuses_: dict | None = None, errors: dict | None = None) -> WorldOutcome:
    ranks = []
    for rank in range(world_size):
        status = (statuses_ or {}).get(rank, "ok")
        ranks.append(RankOutcome(rank, status, result=results[rank] if status == "ok" else None,
                                 error=(errors or {}).get(rank), exitcode=0 if status == "ok" else -6, output=""))
    return WorldOutcome(world_size, ranks)


def refusal(raised: str = "ValueError", value_error: bool | None = None) -> dict:
    return {"raised": raised, "value_error": raised == "ValueError" if value_error is None else value_error,
            "message": "5 attention heads cannot be split evenly over 4 ranks", "events": []}


def refused_status(out: WorldOutcome, pattern: str = "heads") -> tuple[str, str]:
    g = grading(out.world_size)
    verdicts.check_refused(g, out, out.world_size, pattern)
    return statuses(g)["heads-refused"], messages(g)["heads-refused"]


def test_every_rank_refusing_passes():
    assert refused_status(outcome(4, [refusal()] * 4))[0] == "pass"
    assert refused_status(outcome(4, [refusal("HeadsError", value_error=True)] * 4), "kv-heads")[0] == "pass"


def test_an_assert_is_not_a_refusal():
    status, said = refused_status(outcome(4, [refusal("AssertionError")] * 4))
    assert status == "fail" and "rank 0 raised AssertionError" in said and "python -O removes it" in said


def test_a_refusal_on_rank_0_only_fails_and_names_the_other_ranks():
    results = [refusal()] + [refusal("RuntimeError")] * 3
    status, said = refused_status(outcome(4, results))
    assert status == "fail" and "rank 0 raised ValueError, but rank 1 raised RuntimeError" in said
    assert "an accident of the shapes" in said and "only the query heads cannot be split" in said


def test_a_record_that_only_names_a_value_error_is_no_refusal():
    forged = [dict(refusal(), value_error="yes")] * 2
    assert refused_status(outcome(2, forged))[0] == "fail"


def test_a_rank_that_returns_an_output_fails():
    results = [refusal()] * 3 + [{"raised": None, "output": torch.zeros(1), "events": []}]
    status, said = refused_status(outcome(4, results))
    assert status == "fail" and "ranks 0, 1, 2 raised ValueError" in said and "rank 3 did not refuse" in said


def test_a_shape_error_is_an_accident_not_a_refusal():
    status, said = refused_status(outcome(2, [refusal("RuntimeError")] * 2), "kv-heads")
    assert status == "fail" and "accident" in said and "neither 3 nor 2 divides the other" in said


def test_a_rank_that_died_fails():
    status, said = refused_status(outcome(3, [refusal()] * 3, statuses_={1: "killed"}))
    assert status == "fail" and "rank 1's process ended without a result (killed)" in said


def test_refusal_shapes_cannot_be_split():
    for world_size in (2, 3, 4, 5, 6, 8):
        heads, kv, _ = ex_rank.shapes("heads", world_size)
        # Only the query heads' check can refuse: the key/value heads divide the heads and W.
        assert heads % world_size and heads % kv == 0 and world_size % kv == 0
        heads, kv, _ = ex_rank.shapes("kv-heads", world_size)
        assert heads % world_size == 0 and heads % kv == 0 and kv % world_size and world_size % kv
        few = ex_rank.fewer_kv_heads(world_size)
        assert few < world_size and world_size % few == 0


def test_bytes_each_way_follow_the_method():
    # 4 ranks, 8 heads: q and the output 8 heads, k and v 8: each chunk 2 x 8 x 4 x 8 x 8 bytes = 4096.
    assert reference.bytes_to_send("plain", 4) == 4 * 4096 * 3 // 4
    # Fewer key/value heads than ranks: 2 heads copied to 4, so k and v travel as 4 heads each.
    assert reference.bytes_to_send("few-kv", 4) == (2 * 4096 + 2 * 2048) * 3 // 4


def test_the_report_line_survives_records_of_any_shape():
    observations = right_observations(2)
    assert "bytes sent off-rank 4096/4096 (expected 4096)" in verdicts.describe(observations, 2)
    observations[0]["plain"]["held"] = ["not", "a", "dict"]
    observations[1]["plain"] = "nothing"
    line = verdicts.describe(observations, 2)
    assert "held whole at once ?/?" in line and "all-to-alls per forward 4/0" in line
