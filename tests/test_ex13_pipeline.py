"""Exercise 13's measures and verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import torch

from grader import catalog
from grader.checks import ex13_pipeline as ex
from grader.rank.drivers import ex13_pipeline as ex_rank
from grading_helpers import grading_for, verdicts


grading = grading_for("13")


def gpipe_order(m: int) -> list[str]:
    return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]


def one_f_one_b_order(rank: int, world_size: int, m: int) -> list[str]:
    warmup = min(world_size - rank - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    return order + [f"B{i}" for i in range(m - warmup, m)]


def step(order: list[str], peak: int, rows: int = 4, events=(), grads=None, returned=None) -> dict:
    observed = [{"op": label[0], "mb": int(label[1:]), "rows": rows if label[0] == "F" else 0} for label in order]
    return {"observed": observed, "peak_live": peak, "events": list(events), "grads": grads or {},
            "returned": returned or {"type": "NoneType", "value": None}}


# --- the unit-time timeline ---------------------------------------------------------------------


def test_textbook_gpipe_and_1f1b_both_take_two_m_plus_w_minus_one_slots():
    for world_size in (2, 3, 4):
        for m in (world_size, 2 * world_size, 7):
            for orders in ([gpipe_order(m)] * world_size,
                           [one_f_one_b_order(r, world_size, m) for r in range(world_size)]):
                slots = ex.unit_slots(orders)
                assert 1 + max(max(row) for row in slots) == 2 * (m + world_size - 1)


def test_gpipe_timeline_is_the_textbook_staircase():
    slots = ex.unit_slots([gpipe_order(2)] * 2)
    assert slots == [[0, 1, 4, 5], [1, 2, 3, 4]]
    run = ex.timeline_data({"num_microbatches": 2}, [step(gpipe_order(2), 2)] * 2, 2)
    text = ex.timeline_text(run)
    assert "rank 0  F0 F1 .  .  B0 B1" in text and "rank 1  .  F0 F1 B0 B1" in text
    assert run["span"] == 6 and run["idle"] == round(1 - 8 / 12, 4)
    assert "(W - 1) / (M + W - 1) = 1/3 = 33%" in text


def test_one_at_a_time_takes_longer_and_a_missing_forward_does_not_fit():
    sequential = [f"{op}{i}" for i in range(4) for op in "FB"]
    slots = ex.unit_slots([sequential, sequential])
    assert 1 + max(max(row) for row in slots) == 16 > 2 * (4 + 2 - 1)
    assert ex.unit_slots([["F0", "B0"], gpipe_order(2)]) is None


# --- verdicts ---------------------------------------------------------------------------------------


CASE = {"schedule": "gpipe", "num_microbatches": 4, "rows": 4, "measure": True, "seed": 21}


def sends(peer: int, sizes: list[int]) -> list[dict]:
    return [{"op": "isend", "bytes": b, "peer": peer, "async_op": True} for b in sizes]


def test_messages_one_per_micro_batch_with_headers_pass_and_one_big_message_fails():
    act = ex.activation_bytes(CASE, 0)
    good = [step(gpipe_order(4), 4, events=[*sends(1, [72]), *sends(1, [act] * 4)]),
            step(gpipe_order(4), 4, events=sends(0, [act] * 4))]
    g = grading()
    ex.check_messages(g, CASE, good, 2)
    assert verdicts(g)["messages-per-link"][0] == "pass"

    whole = [step(gpipe_order(4), 4, events=sends(1, [4 * act])), good[1]]
    g = grading()
    ex.check_messages(g, CASE, whole, 2)
    status, message = verdicts(g)["messages-per-link"]
    assert status == "fail" and f"rank 0 sent rank 1 1 x {4 * act} bytes" in message and f"{act} bytes each" in message

    no_gradients = [good[0], step(gpipe_order(4), 4)]
    g = grading()
    ex.check_messages(g, CASE, no_gradients, 2)
    status, message = verdicts(g)["messages-per-link"]
    assert status == "fail" and "rank 1 sent rank 0 nothing" in message and "gradients" in message


def test_a_collective_or_a_far_peer_fails_neighbours_only():
    g = grading(3)
    far = [step([], 0, events=[{"op": "recv", "bytes": 4, "peer": 2, "async_op": False}]), step([], 0), step([], 0)]
    ex.check_neighbours(g, CASE, far, 3)
    status, message = verdicts(g)["neighbours-only"]
    assert status == "fail" and "rank 0 received from rank 2" in message

    g = grading(2)
    collective = [step([], 0), step([], 0, events=[{"op": "broadcast", "bytes": 4, "peer": None, "async_op": False}])]
    ex.check_neighbours(g, CASE, collective, 2)
    status, message = verdicts(g)["neighbours-only"]
    assert status == "fail" and "rank 1 called dist.broadcast" in message


def _counted(sent: dict, world_size: int = 3, counted: set | None = None):
    from grader import traffic

    return traffic.RunTraffic(world_size, sent, 0, set(range(world_size)) if counted is None else counted)


# The reference at world size 3, as the kernel counted it: thousands of bytes between neighbours, and between
# ranks 0 and 2 only the opening and closing of their connection.
NEIGHBOURS_ONLY = {(0, 1): 10089, (0, 2): 1, (1, 0): 9841, (1, 2): 14304, (2, 0): 9, (2, 1): 14073}


def test_neighbours_only_stands_on_the_bytes_the_kernel_counted_between_ranks_two_stages_apart():
    g = grading(3)
    ex.check_far_traffic(g, _counted(NEIGHBOURS_ONLY), 3, "gpipe")
    status, _ = verdicts(g)["neighbours-only"]
    assert status == "pass" and g._verdicts["neighbours-only"].evidence == catalog.KERNEL
    # One message between ranks 2 and 0 that no rank recorded (the process group's own send): 97 bytes
    g = grading(3)
    ex.check_far_traffic(g, _counted({**NEIGHBOURS_ONLY, (2, 0): 105, (0, 2): 97}), 3, "gpipe")
    status, message = verdicts(g)["neighbours-only"]
    assert status == "fail" and "rank 0 sent rank 2 97 bytes (the kernel's count)" in message
    g = grading(3)
    ex.check_far_traffic(g, _counted(NEIGHBOURS_ONLY, counted={0, 1}), 3, "1f1b")
    status, message = verdicts(g)["neighbours-only"]
    assert status == "fail" and "rank 2's connections were never counted" in message


def test_schedule_memory_verdicts():
    g = grading()
    ex.check_gpipe(g, CASE, [step(gpipe_order(4), 4), step(gpipe_order(4), 1)], 2)
    status, message = verdicts(g)["gpipe-fill-drain"]
    assert status == "fail" and "rank 1 held" in message and "at most 1 micro-batch(es) at once, not all 4" in message

    case = {**CASE, "schedule": "1f1b"}
    g = grading()
    ex.check_1f1b_memory(g, case, [step(gpipe_order(4), 4), step(gpipe_order(4), 4)], 2)
    status, message = verdicts(g)["1f1b-memory"]
    assert status == "fail" and "rank 0 held the saved activations of 4 micro-batches" in message

    g = grading()
    orders = [one_f_one_b_order(r, 2, 4) for r in range(2)]
    ex.check_1f1b_memory(g, case, [step(orders[0], 2), step(orders[1], 1)], 2)
    ex.check_1f1b_bubble(g, case, [step(orders[0], 2), step(orders[1], 1)], 2)
    assert verdicts(g)["1f1b-memory"][0] == verdicts(g)["1f1b-bubble"][0] == "pass"


def test_micro_batches_counts_forwards_rows_and_backwards():
    g = grading()
    ex.check_micro_batches(g, CASE, [step(["F0", "B0"], 1, rows=16), step(gpipe_order(4), 4)], 2)
    status, message = verdicts(g)["micro-batches"]
    assert status == "fail" and "rank 0 ran its stage forward 1 time(s), on 16 row(s)" in message

    g = grading()
    ex.check_micro_batches(g, CASE, [step(gpipe_order(4)[:6], 4), step(gpipe_order(4), 4)], 2)
    status, message = verdicts(g)["micro-batches"]
    assert status == "fail" and "backward of 2 micro-batch(es)" in message


def test_loss_returned_verdicts():
    _, loss = ex.reference(CASE, 2)
    ok = {"type": "float", "value": loss}
    g = grading()
    ex.check_loss(g, CASE, [step([], 0), step([], 0, returned=ok)], 2)
    assert verdicts(g)["loss-returned"][0] == "pass"

    g = grading()
    ex.check_loss(g, CASE, [step([], 0), step([], 0, returned={"type": "float", "value": 4 * loss})], 2)
    status, message = verdicts(g)["loss-returned"]
    assert status == "fail" and "sum of the micro-batch losses" in message

    g = grading()
    ex.check_loss(g, CASE, [step([], 0), step([], 0, returned={"type": "Tensor", "value": None})], 2)
    assert "returned a Tensor, not a float" in verdicts(g)["loss-returned"][1]

    g = grading()
    ex.check_loss(g, CASE, [step([], 0, returned=ok), step([], 0, returned=ok)], 2)
    assert "rank 0 returned a float" in verdicts(g)["loss-returned"][1]


def test_gradients_scaled_by_the_number_of_micro_batches_are_named_as_such():
    grads, _ = ex.reference(CASE, 2)
    g = grading()
    ex.check_gradients(g, CASE, [step([], 0, grads=grads[0]), step([], 0, grads=grads[1])], 2)
    assert verdicts(g)["grads-match"][0] == "pass"

    g = grading()
    scaled = [{k: 4 * v for k, v in stage.items()} for stage in grads]
    ex.check_gradients(g, CASE, [step([], 0, grads=scaled[0]), step([], 0, grads=scaled[1])], 2)
    status, message = verdicts(g)["grads-match"]
    assert status == "fail" and "on rank 1" in message and "4 times too large" in message

    g = grading()
    wrong_first = {k: v.flip(0) if v.dim() else v for k, v in grads[0].items()}
    ex.check_gradients(g, CASE, [step([], 0, grads=wrong_first), step([], 0, grads=grads[1])], 2)
    status, message = verdicts(g)["grads-match"]
    assert status == "fail" and "on rank 0" in message and "the stages after it match" in message


# --- the instrumented stage, in this process ----------------------------------------------------------


def run_schedule(order: list[str], m: int = 3) -> ex_rank.ObservedStage:
    stage = ex_rank.ObservedStage(ex.build_stages(2)[1])
    xs = torch.randn(m, 2, ex.WIDTHS[1]).unbind(0)
    outputs = {}
    with torch.no_grad():
        stage(xs[0])  # a forward without gradients: not part of the schedule
    for label in order:
        i = int(label[1:])
        if label[0] == "F":
            outputs[i] = stage(xs[i].clone().requires_grad_())
        else:
            outputs.pop(i).sum().backward()
    return stage


def test_observed_stage_counts_micro_batches_alive_and_labels_backwards():
    gpipe = run_schedule(gpipe_order(3))
    assert gpipe.peak_live == 3
    assert [f"{e['op']}{e['mb']}" for e in gpipe.observed if e["op"] != "f"] == gpipe_order(3)
    interleaved = run_schedule(["F0", "B0", "F1", "B1", "F2", "B2"])
    assert interleaved.peak_live == 1
    assert sum(interleaved.live.values()) == 0  # backward freed what forward saved


def test_every_check_of_the_catalog_is_decided_by_the_module():
    ids = {c.id for c in catalog.by_id("13").checks}
    source = open(ex.__file__, encoding="utf-8").read()
    assert all(f'"{check_id}"' in source for check_id in ids)
