"""Exercise 53's inputs, references and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import torch

from grader.checks.ex53_async_tp import reference as ref
from grader.checks.ex53_async_tp import verdicts as v
from grader.rank.drivers import ex53_async_tp as rank_side
from grading_helpers import grading_for, verdicts

grading = grading_for("53")
ROWS, K, M = rank_side.ROWS, rank_side.GATHER["k"], rank_side.GATHER["m"]


def test_inputs_differ_by_rank_seed_scenario_and_function():
    a = rank_side.inputs(1, "world", "allgather_matmul", 0, 4)
    assert not torch.equal(a["x"], rank_side.inputs(1, "world", "allgather_matmul", 1, 4)["x"])
    assert not torch.equal(a["x"], rank_side.inputs(2, "world", "allgather_matmul", 0, 4)["x"])
    assert not torch.equal(a["x"], rank_side.inputs(1, "pairs", "allgather_matmul", 0, 2)["x"])
    assert a["x"].shape == (ROWS, K) and a["grad"].shape == (4 * ROWS, M)


def test_the_smallest_chunk_is_kept():
    assert rank_side.SMALLEST_KEPT <= ROWS * K * 8 and rank_side.SMALLEST_KEPT <= ROWS * rank_side.REDUCE["m"] * 8


def test_the_reference_is_the_all_gather_then_matmul_and_its_autograd():
    seed, size = 4, 3
    want = ref.expected(seed, "world", "allgather_matmul", size)
    args = [rank_side.inputs(seed, "world", "allgather_matmul", r, size) for r in range(size)]
    xs = [a["x"].clone().requires_grad_() for a in args]
    ws = [a["weight"].clone().requires_grad_() for a in args]
    gathered = torch.cat(xs)
    sum(((gathered @ w) * a["grad"]).sum() for w, a in zip(ws, args)).backward()
    for r in range(size):
        assert torch.allclose(want[r]["output"], gathered.detach() @ ws[r].detach())
        assert torch.allclose(want[r]["grads"]["x"], xs[r].grad)
        assert torch.allclose(want[r]["grads"]["weight"], ws[r].grad)


def test_the_reduce_scatter_reference_is_the_matmul_then_reduce_scatter_and_its_autograd():
    seed, size = 4, 4
    want = ref.expected(seed, "pairs", "matmul_reduce_scatter", size)
    for members in rank_side.groups_of("pairs", size):
        args = [rank_side.inputs(seed, "pairs", "matmul_reduce_scatter", r, len(members)) for r in members]
        xs = [a["x"].clone().requires_grad_() for a in args]
        ws = [a["weight"].clone().requires_grad_() for a in args]
        total = sum(x @ w for x, w in zip(xs, ws))
        outs = list(total.split(ROWS))
        sum((o * a["grad"]).sum() for o, a in zip(outs, args)).backward()
        for i, r in enumerate(members):
            assert torch.allclose(want[r]["output"], outs[i].detach())
            assert torch.allclose(want[r]["grads"]["x"], xs[i].grad)
            assert torch.allclose(want[r]["grads"]["weight"], ws[i].grad)


def test_values_name_rows_in_the_wrong_place_a_missing_gradient_and_the_first_real_error():
    want = ref.expected(1, "world", "allgather_matmul", 3)
    good = [{"output": w["output"], "grads": dict(w["grads"]), "error": None} for w in want]
    g = grading(3)
    assert v.check_values(g, "allgather-matmul-output", good, want, "allgather_matmul", "output", 3)
    swapped = [dict(r) for r in good]
    blocks = list(want[1]["output"].split(ROWS))
    swapped[1]["output"] = torch.cat([blocks[0], blocks[2], blocks[1]])
    g = grading(3)
    v.check_values(g, "allgather-matmul-output", swapped, want, "allgather_matmul", "output", 3)
    status, message = verdicts(g)["allgather-matmul-output"]
    assert status == "fail" and "rank 1" in message and "hold group rank 2's rows" in message
    missing = [dict(r, grads={"x": r["grads"]["x"]}) for r in good]
    g = grading(3)
    v.check_values(g, "allgather-matmul-grads", missing, want, "allgather_matmul", "grads", 3)
    status, message = verdicts(g)["allgather-matmul-grads"]
    assert status == "fail" and "weight.grad is None" in message
    failed = [dict(r) for r in good]
    failed[0] = dict(failed[0], error="RuntimeError: Connection closed by peer")
    failed[2] = dict(failed[2], error="ValueError: bad shapes")
    g = grading(3)
    v.check_values(g, "allgather-matmul-output", failed, want, "allgather_matmul", "output", 3)
    status, message = verdicts(g)["allgather-matmul-output"]
    assert status == "fail" and "rank 2 raised ValueError" in message


# --- memory -----------------------------------------------------------------------------------------------------


def chunks(size: int) -> list[torch.Tensor]:
    return [rank_side.inputs(9, "world", "allgather_matmul", r, size)["x"] for r in range(size)]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def memory(size: int, held: list[torch.Tensor], rank: int = 0, function: str = "allgather_matmul") -> str:
    contents = [raw(t) for t in held]
    record = {"events": [{"op": "matmul", "held": list(range(len(contents)))}], "returned": 1}
    prints = ref.fingerprints(9, "world", function, size, rank)
    return v.memory_message(record, contents, prints, function, size)


def test_the_whole_gathered_input_is_found_from_three_ranks_on():
    assert memory(2, [torch.cat(chunks(2))]) == ""  # two ranks: a ring holds both chunks anyway
    message = memory(3, [torch.cat(chunks(3)), torch.zeros(3)])
    assert "the whole gathered input" in message and "in forward" in message
    padded = torch.cat([torch.zeros(5, K, dtype=torch.float64), torch.cat(chunks(3))])
    assert "the whole gathered input" in memory(3, [padded])


def test_with_four_ranks_three_other_chunks_at_once_are_too_many_and_two_are_not():
    parts = chunks(4)
    assert memory(4, [parts[0], parts[1], parts[2]]) == ""
    message = memory(4, [parts[0], parts[1], torch.cat([parts[3], torch.zeros(1, K, dtype=torch.float64)]),
                         parts[2]])
    assert "3 other ranks' chunks at once" in message


def test_the_whole_product_is_found_to_within_rounding():
    args = rank_side.inputs(9, "world", "matmul_reduce_scatter", 1, 3)
    product = args["x"] @ args["weight"]
    near = product * (1 + 1e-14)
    assert "whole product" in memory(3, [near], rank=1, function="matmul_reduce_scatter")
    assert memory(3, [product[:ROWS], product[ROWS:2 * ROWS]], rank=1, function="matmul_reduce_scatter") == ""
    assert memory(3, [product + 1e-3], rank=1, function="matmul_reduce_scatter") == ""


# --- traffic and order -------------------------------------------------------------------------------------------


def ring_events(size: int, rank: int, *, chunk_bytes: int = ROWS * K * 8, to: int | None = None,
                wait_first=False, blocking=False) -> list[dict]:
    """One forward call as the reference's rank records it: per step isend, irecv, matmul, waits."""
    to = (rank + 1) % size if to is None else to
    events, n = [{"op": "mark", "what": "call-begins"}], 0
    for step in range(size):
        if step < size - 1:
            events.append({"op": "isend" if not blocking else "send", "peer": to, "bytes": chunk_bytes, "id": n,
                           "async_op": not blocking})
            events.append({"op": "irecv", "peer": (rank - 1) % size, "bytes": chunk_bytes, "id": n + 1,
                           "async_op": True})
            if wait_first:
                events += [{"op": "wait", "id": n}, {"op": "wait", "id": n + 1}]
        events.append({"op": "matmul", "held": []})
        if step < size - 1 and not wait_first:
            events += [{"op": "wait", "id": n}, {"op": "wait", "id": n + 1}]
        n += 2
    events.append({"op": "mark", "what": "call-returned"})
    return events


def record_of(events: list[dict]) -> dict:
    return {"events": events, "returned": len(events) - 1}


def test_the_reference_ring_passes_traffic_and_order():
    for size in (2, 3, 4):
        for rank in range(size):
            record = record_of(ring_events(size, rank))
            assert v.traffic_message(record, rank, list(range(size)), "allgather_matmul") == ""
            assert v.order_message(record) == ""


def test_traffic_names_a_stranger_the_wrong_bytes_and_a_collective():
    record = record_of(ring_events(4, 0, to=2))
    assert "not its ring neighbours" in v.traffic_message(record, 0, [0, 1, 2, 3], "allgather_matmul")
    record = record_of(ring_events(3, 0, chunk_bytes=ROWS * K * 4))
    assert "it sent 384 bytes" in v.traffic_message(record, 0, [0, 1, 2], "allgather_matmul")
    events = ring_events(3, 1)
    events.insert(1, {"op": "all_gather_into_tensor", "bytes": 3 * ROWS * K * 8, "id": 99, "async_op": False})
    assert "all_gather_into_tensor" in v.traffic_message(record_of(events), 1, [0, 1, 2], "allgather_matmul")
    # On a group the neighbours are the group's, by their global ranks.
    record = record_of(ring_events(2, 1, to=3))
    assert v.traffic_message(record, 1, [1, 3], "allgather_matmul") == ""


def test_sending_to_both_neighbours_is_not_a_ring():
    events = ring_events(4, 0)
    second = next(i for i, e in enumerate(events) if e["op"] == "isend" and e["id"] == 2)
    events[second] = dict(events[second], peer=3)
    assert "both its ring neighbours" in v.traffic_message(record_of(events), 0, [0, 1, 2, 3], "allgather_matmul")


def test_order_names_waits_before_the_matmul_a_blocking_send_and_a_transfer_never_waited_for():
    assert "waited for before any matrix product" in v.order_message(record_of(ring_events(3, 0, wait_first=True)))
    assert "blocking send" in v.order_message(record_of(ring_events(3, 0, blocking=True)))
    events = [e for e in ring_events(3, 0) if not (e["op"] == "wait" and e["id"] == 1)]
    assert "never waited for" in v.order_message(record_of(events))


def test_rank_records_skip_calls_that_failed_and_name_the_group():
    calls = {("world", "allgather_matmul"): [{"error": "RuntimeError: x", "events": []}] * 2,
             ("pairs", "matmul_reduce_scatter"): [{"error": None, "events": []}] * 4}
    g = grading(4)
    v.check_rank_records(g, "ring-traffic", lambda s, f, r, record: "sent to rank 9" if r == 3 else "", calls, 4)
    status, message = verdicts(g)["ring-traffic"]
    assert status == "fail" and message.startswith("matmul_reduce_scatter(x, weight_shard, group) on the group [1, 3]")
