"""Exercise 16's measures and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import functools

import torch

from grader import catalog
from grader.rank.drivers import ex16_ring_attention as rank_side
from grader.checks.ex16_ring_attention import reference as ref
from grader.checks.ex16_ring_attention import verdicts as checks
from grading_helpers import grading_for, verdicts
from grader.rank.harness import RankOutcome, WorldOutcome

BLOCK = rank_side.BATCH * rank_side.HEADS * rank_side.CHUNK * rank_side.HEAD_DIM * 8  # bytes of one K or V block, float64
UNIT = rank_side.block_macs()


grading = grading_for("16")


@functools.cache
def expected(world_size: int) -> dict:
    return ref.expected_for(world_size)


def p2p(op: str, peer: int, blocks: int = 1) -> dict:
    return {"op": op, "bytes": blocks * BLOCK, "peer": peer, "async_op": op in ("isend", "irecv")}


def ring_events(rank: int, members: list[int], hops: int) -> list[dict]:
    """K and V sent to the next rank and received from the previous one, ``hops`` times."""
    if len(members) < 2:
        return []
    i = members.index(rank)
    after, before = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
    events = []
    for _ in range(hops):
        events += [p2p("isend", after), p2p("isend", after), p2p("irecv", before), p2p("irecv", before)]
    return events


def right_run(want: dict, rows: list[int], rank: int, members: list[int], blocks_computed: float) -> dict:
    """What a right rank records for one scenario."""
    size = len(members)
    lengths = {"op": "all_reduce", "bytes": 16, "peer": None, "async_op": False}
    return {
        "output": checks._chunk(want["output"], rows).clone(),
        "grads": {name: checks._chunk(want[name], rows).clone() for name in ("q", "k", "v")},
        "backward_ran": True,
        "forward_events": [lengths] + ring_events(rank, members, size - 1),
        # Backward: K and V make W - 1 hops, their gradients W.
        "backward_events": ring_events(rank, members, size - 1) + ring_events(rank, members, size),
        "forward_macs": rank_side.FORWARD_PER_BLOCK * blocks_computed * UNIT,
        "backward_macs": 5 * blocks_computed * UNIT,
        "held": {"most": [], "where": "", "probes": 0},
    }


def right_observations(world_size: int) -> list[dict]:
    want = expected(world_size)
    everyone = list(range(world_size))
    observations = []
    for rank in range(world_size):
        rows = rank_side.positions(rank, world_size)
        obs = {
            "plain": right_run(want["plain"], rows, rank, everyone, world_size),
            "causal": right_run(want["causal"], rows, rank, everyone, rank + 1),
            "large": right_run(want["large"], rows, rank, everyone, world_size),
            "zigzag": right_run(want["zigzag"], rank_side.positions(rank, world_size, zigzag=True), rank, everyone,
                                (world_size + 1) / 2),
        }
        if world_size > rank_side.MOST_HELD + 1:
            obs["plain"]["held"]["most"] = [r for r in ((rank - 1) % world_size, (rank - 2) % world_size)]
        members = next(m for m in rank_side.groups_of(world_size) if rank in m)
        obs["group"] = right_run(want["group"][len(members)], rank_side.positions(members.index(rank), len(members)),
                                 rank, members, len(members))
        obs["group"]["members"] = members
        observations.append(obs)
    return observations


def grade_all(observations: list[dict], world_size: int) -> dict:
    g = grading(world_size)
    want = expected(world_size)
    checks.check_outputs(g, observations, want, world_size)
    checks.check_gradients(g, observations, want, world_size)
    checks.check_stable(g, observations, want["large"], world_size)
    checks.check_neighbours(g, observations, world_size)
    checks.check_hops(g, observations, world_size)
    checks.check_causal_work(g, observations, world_size)
    checks.check_held(g, observations, world_size)
    checks.check_group(g, observations, want["group"], world_size)
    checks.check_zigzag(g, observations, want["zigzag"], world_size)
    checks.check_uneven(g, refusals(world_size), world_size)
    return verdicts(g)


def outcome(world_size: int, results: list | None = None, statuses: dict | None = None,
            errors: dict | None = None) -> WorldOutcome:
    ranks = []
    for rank in range(world_size):
        status = (statuses or {}).get(rank, "ok")
        ranks.append(RankOutcome(rank, status, result=None if results is None else results[rank],
                                 error=(errors or {}).get(rank), exitcode=-6 if status == "exited" else 0,
                                 output="gloo: Received data size doesn't match expected size" if status == "exited"
                                 else ""))
    return WorldOutcome(world_size, ranks)


def refusals(world_size: int, raised: str = "ValueError") -> WorldOutcome:
    lengths = [len(rows) for rows in rank_side.uneven_positions(world_size)]
    return outcome(world_size, [{"raised": raised, "message": f"lengths {lengths}", "length": n} for n in lengths])


def test_a_right_record_passes_every_check_at_each_world_size():
    for world_size in (2, 3, 4):
        got = grade_all(right_observations(world_size), world_size)
        assert {status for status, _ in got.values()} == {"pass"}, got
        assert set(got) == {c.id for c in catalog.by_id("16").checks}


def test_the_chunks_and_the_zigzag_halves_cover_the_sequence_once():
    for world_size in (1, 2, 3, 4):
        for zigzag in (False, True):
            held = sorted(p for r in range(world_size) for p in rank_side.positions(r, world_size, zigzag))
            assert held == list(range(rank_side.CHUNK * world_size))
    assert rank_side.positions(0, 2, zigzag=True) == [0, 1, 6, 7] and rank_side.positions(1, 2, zigzag=True) == [2, 3, 4, 5]
    assert [len(rows) for rows in rank_side.uneven_positions(3)] == [5, 4, 4]
    assert rank_side.groups_of(4) == [[0, 2, 3], [1]] and rank_side.groups_of(3) == [[0, 2], [1]] and rank_side.groups_of(2) == [[0], [1]]


def test_an_output_without_the_scale_or_the_other_blocks_is_named():
    observations = right_observations(3)
    data = rank_side.make_inputs("plain", 3 * rank_side.CHUNK)
    rows = rank_side.positions(1, 3)
    observations[1]["plain"]["output"] = checks._chunk(ref.attention(data["q"], data["k"], data["v"], scale=False), rows)
    status, message = grade_all(observations, 3)["matches-attention"]
    assert status == "fail" and message.startswith("world size 3, rank 1 (non-causal, positions 4-7 of 12)")
    assert "without the 1/sqrt(head_dim) scale" in message
    observations = right_observations(2)
    own = [checks._chunk(data2, rank_side.positions(0, 2)) for data2 in
           (rank_side.make_inputs("plain", 8)[name] for name in ("q", "k", "v"))]
    observations[0]["plain"]["output"] = ref.attention(*own)
    status, message = grade_all(observations, 2)["matches-attention"]
    assert status == "fail" and "this rank's own chunk alone" in message


def test_a_causal_output_without_the_mask_or_with_the_own_block_unmasked_is_named():
    observations = right_observations(2)
    observations[1]["causal"]["output"] = observations[1]["plain"]["output"]  # another seed: no match
    data = rank_side.make_inputs("causal", 8)
    observations[1]["causal"]["output"] = checks._chunk(ref.attention(data["q"], data["k"], data["v"]), [4, 5, 6, 7])
    got = grade_all(observations, 2)
    assert got["causal-matches"][0] == "fail" and "no mask was applied" in got["causal-matches"][1]
    assert got["matches-attention"][0] == "pass"
    observations = right_observations(2)
    upper = torch.ones(8, 8, dtype=torch.bool).triu(1)
    upper[:4, :4] = False  # rank 0's own block left unmasked
    observations[0]["causal"]["output"] = checks._chunk(
        ref.attention(data["q"], data["k"], data["v"], mask=upper), [0, 1, 2, 3])
    status, message = grade_all(observations, 2)["causal-matches"]
    assert status == "fail" and "own block left unmasked" in message


def test_gradients_that_never_came_home_are_named():
    observations = right_observations(2)
    data = rank_side.make_inputs("plain", 8)
    q, k, v = (data[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
    mine = torch.zeros_like(data["g"])
    mine[:, :, 4:] = data["g"][:, :, 4:]
    (ref.attention(q, k, v) * mine).sum().backward()
    observations[1]["plain"]["grads"]["k"] = checks._chunk(k.grad, [4, 5, 6, 7])
    observations[1]["plain"]["grads"]["v"] = checks._chunk(v.grad, [4, 5, 6, 7])
    got = grade_all(observations, 2)
    status, message = got["grads-match"]
    assert status == "fail" and message.startswith("world size 2, rank 1") and "'k.grad' differs" in message
    assert "never came back to it" in message
    assert got["causal-grads-match"][0] == got["matches-attention"][0] == "pass"
    observations = right_observations(2)
    observations[0]["causal"]["backward_ran"] = False
    status, message = grade_all(observations, 2)["causal-grads-match"]
    assert status == "fail" and "no backward could be run" in message


def test_inf_or_nan_at_large_logits_fails_stability_only():
    observations = right_observations(2)
    observations[0]["large"]["output"] = torch.full_like(observations[0]["large"]["output"], float("nan"))
    got = grade_all(observations, 2)
    status, message = got["stable-large-logits"]
    assert status == "fail" and "multiplied by 1000" in message and "(output hold inf or NaN)" in message
    assert got["matches-attention"][0] == "pass"
    observations = right_observations(2)
    observations[1]["large"]["grads"]["q"][0, 0, 0, 0] = float("inf")
    status, message = grade_all(observations, 2)["stable-large-logits"]
    assert status == "fail" and "the gradients" in message and "q hold inf or NaN" in message
    observations = right_observations(2)
    observations[0]["large"] = {"error": "RuntimeError: boom"}
    status, message = grade_all(observations, 2)["stable-large-logits"]
    assert status == "fail" and "ring_attention raised RuntimeError: boom" in message


def test_messages_to_non_neighbours_and_large_collectives_fail_small_ones_pass():
    observations = right_observations(4)
    observations[0]["plain"]["backward_events"].append(p2p("isend", 2))
    status, message = grade_all(observations, 4)["ring-neighbours"]
    assert status == "fail" and "rank 0, non-causal backward: dist.isend of 1024 bytes to rank 2" in message
    assert "rank 0's are 1, 3" in message
    observations = right_observations(3)
    observations[2]["causal"]["forward_events"].insert(0, {"op": "all_gather", "bytes": 3 * BLOCK, "peer": None,
                                                           "async_op": False})
    status, message = grade_all(observations, 3)["ring-neighbours"]
    assert status == "fail" and "dist.all_gather of 3072 bytes" in message
    observations = right_observations(3)
    observations[1]["plain"]["forward_events"].append({"op": "all_gather", "bytes": rank_side.SMALL_MESSAGE, "peer": None,
                                                       "async_op": False})
    assert grade_all(observations, 3)["ring-neighbours"][0] == "pass"


def test_an_extra_hop_or_missing_blocks_fail_the_hop_count():
    observations = right_observations(3)
    observations[1]["plain"]["forward_events"] += ring_events(1, [0, 1, 2], 1)
    status, message = grade_all(observations, 3)["ring-hops"]
    assert status == "fail" and "rank 1, non-causal forward: it sent 6144 bytes in 6 message(s) (6 block(s))" in message
    assert "2 x 2 blocks" in message and "= 4096 bytes" in message
    observations = right_observations(3)
    observations[2]["causal"]["forward_events"] = observations[2]["causal"]["forward_events"][:-4]  # last hop kept home
    assert grade_all(observations, 3)["ring-hops"][0] == "pass"
    observations = right_observations(2)
    observations[0]["plain"]["forward_events"] = [e for e in observations[0]["plain"]["forward_events"]
                                                  if e["op"] != "irecv"]
    status, message = grade_all(observations, 2)["ring-hops"]
    assert status == "fail" and "it received 0 bytes" in message


def test_future_blocks_computed_fail_on_the_rank_that_spends_them():
    observations = right_observations(4)
    for rank, obs in enumerate(observations):
        obs["causal"]["forward_macs"] = 2 * 4 * UNIT  # every block, masked
    status, message = grade_all(observations, 4)["causal-skips-future"]
    assert status == "fail" and message.startswith("world size 4, rank 0, causal=True forward: its matrix products "
                                                   "came to 8 block products")
    assert "at most: 2. The 3 block(s) of later ranks" in message
    observations = right_observations(4)
    observations[1]["causal"]["backward_macs"] = 6 * 2 * UNIT + UNIT
    status, message = grade_all(observations, 4)["causal-skips-future"]
    assert status == "fail" and "rank 1, causal=True backward" in message
    observations = right_observations(4)
    observations[1]["causal"]["backward_macs"] = 6 * 2 * UNIT  # recomputing the output too is allowed
    observations[3]["causal"]["forward_macs"] = 1.5 * UNIT  # half the diagonal block, cleverly
    assert grade_all(observations, 4)["causal-skips-future"][0] == "pass"


def test_three_other_blocks_held_at_once_fail():
    observations = right_observations(4)
    observations[2]["causal"]["held"] = {"most": [0, 1, 3], "where": "after forward (what is kept for backward)",
                                         "probes": 9}
    status, message = grade_all(observations, 4)["two-blocks-held"]
    assert status == "fail" and message.startswith("world size 4, rank 2, causal=True: after forward")
    assert "3 other ranks were in its memory at once (ranks 0, 1, 3" in message


def test_a_ring_that_ignores_its_group_fails():
    observations = right_observations(4)
    observations[2]["group"]["output"] = observations[2]["plain"]["output"][:, :, :4]
    status, message = grade_all(observations, 4)["uses-group"]
    assert status == "fail" and "rank 2 in group=[0, 2, 3]" in message and "rank 1 of 3 there" in message
    observations = right_observations(4)
    observations[3]["group"]["forward_events"].append(p2p("isend", 1))
    status, message = grade_all(observations, 4)["uses-group"]
    assert status == "fail" and "to rank 1, not a ring neighbour (rank 3's are 0, 2)" in message
    observations = right_observations(4)
    observations[1]["group"]["forward_events"].append(p2p("isend", 2))
    status, message = grade_all(observations, 4)["uses-group"]
    assert status == "fail" and "rank 1's are none (a ring of one rank)" in message
    observations = right_observations(3)
    observations[1]["group"] = {"error": "ValueError: Invalid destination rank", "members": [1]}
    status, message = grade_all(observations, 3)["uses-group"]
    assert status == "fail" and "it raised ValueError: Invalid destination rank" in message


def test_zigzag_absent_skips_wrong_fails_and_whole_blocks_are_unbalanced():
    observations = right_observations(3)
    for obs in observations:
        obs["zigzag"] = {"absent": True}
    g = grading(3)
    assert checks.check_zigzag(g, observations, expected(3)["zigzag"], 3) == "absent"
    observations = right_observations(3)
    observations[1]["zigzag"]["output"] = observations[1]["causal"]["output"]
    got = grade_all(observations, 3)
    assert got["zigzag-matches"][0] == "fail" and "chunks 1 and 4 of 6" in got["zigzag-matches"][1]
    assert got["zigzag-balanced"][0] == "not-checked"
    observations = right_observations(4)
    observations[0]["zigzag"]["forward_macs"] = 2 * 4 * UNIT  # whole blocks, masked
    status, message = grade_all(observations, 4)["zigzag-balanced"]
    assert status == "fail" and "rank 0, zigzag forward" in message and "at most: 5" in message
    observations = right_observations(2)
    observations[1]["zigzag"] = {"not_implemented": True}
    status, message = grade_all(observations, 2)["zigzag-matches"]
    assert status == "fail" and "NotImplementedError on this rank only" in message


def test_uneven_chunks_refused_everywhere_pass_anything_else_fails():
    g = grading(4)
    checks.check_uneven(g, refusals(4, "AssertionError"), 4)
    assert verdicts(g)["uneven-refused"][0] == "pass"
    g = grading(4)
    checks.check_uneven(g, refusals(4, "RuntimeError"), 4)
    status, message = verdicts(g)["uneven-refused"]
    assert status == "fail" and "chunks of lengths [5, 4, 4, 4]" in message and "an accident of the lengths" in message
    g = grading(3)
    results = [{"raised": "ValueError", "message": "x", "length": 5}, {"raised": None, "length": 4},
               {"raised": None, "length": 4}]
    checks.check_uneven(g, outcome(3, results), 3)
    status, message = verdicts(g)["uneven-refused"]
    assert status == "fail" and "rank 0 raised ValueError, but rank 1 did not refuse: it returned an output" in message
    g = grading(2)
    checks.check_uneven(g, outcome(2, [None, None], statuses={1: "exited"}), 2)
    status, message = verdicts(g)["uneven-refused"]
    assert status == "fail" and "rank 1's process ended without a result (exit code -6)" in message
    assert "Received data size" in message


def test_a_sum_that_hides_uneven_chunks_is_tried_and_a_rank_left_in_the_ring_fails():
    assert rank_side.uneven_lengths(3, "sum-hides") == [3, 5, 4]
    assert rank_side.uneven_lengths(4, "sum-hides") == [3, 5, 4, 4]
    for world_size in (2, 3, 4):  # each pattern covers the sequence once, in rank order
        for pattern in rank_side.UNEVEN_PATTERNS:
            rows = [p for r in rank_side.uneven_positions(world_size, pattern) for p in r]
            assert rows == list(range(sum(rank_side.uneven_lengths(world_size, pattern))))
            assert len(set(rank_side.uneven_lengths(world_size, pattern))) > 1
    # A check that compares the total with W times its own length: the ranks holding 4 go on, and the ring
    # times out on them once the others have refused.
    results = [{"raised": "ValueError", "message": "15 is not 4 chunks of 3", "length": 3},
               {"raised": "ValueError", "message": "16 is not 4 chunks of 5", "length": 5},
               {"raised": "RuntimeError", "message": "Timed out waiting 5000ms for recv operation", "length": 4},
               {"raised": "RuntimeError", "message": "Timed out waiting 5000ms for recv operation", "length": 4}]
    g = grading(4)
    checks.check_uneven(g, outcome(4, results), 4, "sum-hides")
    status, message = verdicts(g)["uneven-refused"]
    assert status == "fail" and "chunks of lengths [3, 5, 4, 4] (their sum is 16 = 4 x 4" in message
    assert "ranks 0, 1 raised ValueError, but rank 2 did not refuse: it went on and raised RuntimeError" in message
    assert "not only a neighbour's or the total" in message
    g = grading(4)
    checks.check_uneven(g, refusals(4), 4, "sum-hides")
    assert verdicts(g)["uneven-refused"][0] == "pass"


def test_uneven_chunks_computed_right_everywhere_pass():
    want = ref.reference("uneven", 3 * rank_side.CHUNK + 1, False)
    results = []
    for rows in rank_side.uneven_positions(3):
        results.append({"raised": None, "length": len(rows), "output": checks._chunk(want["output"], rows),
                        "grads": {name: checks._chunk(want[name], rows) for name in ("q", "k", "v")}})
    g = grading(3)
    checks.check_uneven(g, outcome(3, results), 3)
    assert verdicts(g)["uneven-refused"][0] == "pass"
    results[2]["output"] = results[2]["output"] * 2
    g = grading(3)
    checks.check_uneven(g, outcome(3, results), 3)
    status, message = verdicts(g)["uneven-refused"]
    assert status == "fail" and "no rank refused, and rank 2's result is wrong" in message


def test_matrix_products_are_counted_in_multiply_adds_whatever_wrote_them():
    calls = []
    watch = rank_side._watch_class()(lambda: calls.append(1))
    a, b = torch.randn(2, 3, 4, 5, dtype=torch.float64), torch.randn(2, 3, 5, 6, dtype=torch.float64)
    with watch:
        a @ b
        torch.einsum("bhij,bhjk->bhik", a, b)
        torch.ones(3, 4) @ torch.ones(4, 2)
        a + 1
    assert watch.macs == 2 * (2 * 3 * 4 * 5 * 6) + 3 * 4 * 2 and len(calls) == 3
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    watch = rank_side._watch_class()(lambda: None)
    with watch:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert watch.macs == 2 * (2 * 4 * 4 * 8)


def test_another_ranks_block_is_found_in_memory_and_copies_leave_nothing_behind():
    import types

    module = types.ModuleType("learner_like")
    block = torch.randn(2, 3, dtype=torch.float64)
    fingerprint = rank_side._block_bytes(block.clone())
    module.cache = [block]
    held = rank_side.HeldBlocks({5: [fingerprint]}, module, "/nonexistent.py")
    held.probe("in forward")
    assert held.record() == {"most": [5], "where": "in forward", "probes": 1}
    module.cache = [torch.zeros(2, 3, dtype=torch.float64)]
    held = rank_side.HeldBlocks({5: [fingerprint]}, module, "/nonexistent.py")
    held.probe("in forward")
    assert held.record()["most"] == []
    copy = torch.randn(4, dtype=torch.float64)
    raw = rank_side._block_bytes(copy)
    assert len(raw) == 32 and not copy.any()


def test_a_wrong_backward_at_every_logit_scale_is_grads_match_not_an_overflow():
    """A backward wrong at ordinary logits is not a matter of stability, even where the forward is stable."""
    observations = right_observations(2)
    for obs in observations:
        for scenario in ("plain", "large"):
            obs[scenario]["grads"]["v"] = obs[scenario]["grads"]["v"] * 2
    got = grade_all(observations, 2)
    assert got["grads-match"][0] == "fail"
    g = grading(2)
    checks.check_gradients(g, observations, expected(2), 2)
    checks.check_stable(g, observations, expected(2)["large"], 2)
    stable = next(c for c in g.results(None) if c.id == "stable-large-logits")
    assert stable.status == "not-checked" and stable.likely_cause == "grads-match"
    assert "overflows" not in stable.message
    # Wrong only at large logits: the forward is stable, the backward overflows.
    observations = right_observations(2)
    observations[1]["large"]["grads"]["q"] = observations[1]["large"]["grads"]["q"] * float("nan")
    status, message = grade_all(observations, 2)["stable-large-logits"]
    assert status == "fail" and "rank 1" in message and "the output is right (the forward is stable)" in message
    assert "q hold inf or NaN" in message


def test_an_output_right_to_float32_only_is_named_so_not_the_own_chunk_on_rank_0():
    """Rank 0's causal output is attention over its own chunk: that candidate is the right answer, and must not
    be matched at a tolerance looser than the check's."""
    observations = right_observations(3)
    out = observations[0]["causal"]["output"]
    observations[0]["causal"]["output"] = out.float().double()  # float32 rounding: off by about 1e-8
    status, message = grade_all(observations, 3)["causal-matches"]
    assert status == "fail" and "rank 0" in message
    assert "own chunk alone" not in message and "right to float32's precision only" in message
    # Another rank's output that really is its own chunk's attention is still named.
    data = rank_side.make_inputs("causal", 3 * rank_side.CHUNK)
    rows = rank_side.positions(1, 3)
    own = ref.attention(*(checks._chunk(data[n], rows) for n in ("q", "k", "v")), True)
    observations[0]["causal"]["output"] = out
    observations[1]["causal"]["output"] = own
    status, message = grade_all(observations, 3)["causal-matches"]
    assert status == "fail" and "it equals attention over this rank's own chunk alone" in message
