"""Exercise 52's schedule, unit-time model and verdicts, from hand-made records and from the observed stage run in
this process (no process group started)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import schedules as torch_schedules

from conftest import ROOT
from grader.checks.ex52_zero_bubble import reference as ref
from grader.checks.ex52_zero_bubble import verdicts as ex
from grader.rank.drivers import ex52_zero_bubble as driver
from grading_helpers import grading_for, verdicts

grading = grading_for("52")
SIZES = [(w, m) for w in (2, 3, 4) for m in sorted({w, w + 1, 2 * w, 3 * w})]


def _passes(token_rows: list[list[str]]) -> list[list[str]]:
    return [[t for t in row if t[0] in "FBW"] for row in token_rows]


# --- the schedule ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size,m", SIZES)
def test_zb_h1_is_torchs_zero_bubble_order_with_one_stage_per_rank(world_size, m):
    """torch.distributed.pipelining's ScheduleInterleavedZeroBubble builds each rank's actions with
    _get_1f1b_rank_ops(enable_zero_bubble=True); with one stage per rank they are ZB-H1's (I is our B)."""
    for rank in range(world_size):
        warmup = torch_schedules._get_warmup_ops(rank, 1, m, world_size, m, multiply_factor=1)
        actions = torch_schedules._get_1f1b_rank_ops(1, world_size, warmup, m - warmup, warmup, rank,
                                                     lambda step: rank, lambda step: rank, rank,
                                                     enable_zero_bubble=True)
        names = {"F": "F", "I": "B", "W": "W"}
        theirs = [f"{names[a.computation_type.value]}{a.microbatch_index}" for a in actions if a is not None]
        assert theirs == ref.zb_h1_order(rank, world_size, m)


@pytest.mark.parametrize("world_size,m", SIZES)
def test_zb_h1_idles_a_third_of_1f1b_and_holds_w_micro_batches(world_size, m):
    runs = ref.expected_runs(world_size, m)
    zb_idle, zb_span = ex.idle_slots(runs["zb-h1"])
    one_idle, one_span = ex.idle_slots(runs["1f1b"])
    assert one_idle == 3 * world_size * (world_size - 1) and one_span == 3 * (m + world_size - 1)
    assert zb_idle == world_size * (world_size - 1) and zb_span == 3 * m + world_size - 1
    for rank, order in enumerate(_passes(runs["zb-h1"])):
        live = peak = 0
        for label in order:  # a micro-batch's graph lives from its F to its W
            live += {"F": 1, "B": 0, "W": -1}[label[0]]
            peak = max(peak, live)
        assert peak == world_size  # 1F1B's rank 0 holds W too: ZB-H1 holds no more on any rank


def test_w_right_after_b_with_the_gradient_sent_first_halves_the_bubble_only():
    for world_size in (2, 3, 4):
        m = 2 * world_size
        split_at_once = [ref.with_sends(ref.one_f_one_b_order(r, world_size, m), r, world_size, fused=False)
                         for r in range(world_size)]
        assert ex.idle_slots(split_at_once)[0] == 2 * world_size * (world_size - 1)


def test_the_statements_slot_table_is_what_the_report_draws():
    runs = ref.expected_runs(4, 8)
    steps = [record(tokens, 4, rank=r) for r, tokens in enumerate(runs["zb-h1"])]
    text = ex.timeline_text(ex.timeline_data({"num_microbatches": 8, "rows": 4}, steps, 4))
    drawn = [line.split("(peak")[0].rstrip() for line in text.splitlines() if line.startswith("  rank")]
    for name in ("exercises/52_zero_bubble.py", "solutions/52_zero_bubble.py"):
        statement = (ROOT / name).read_text()
        for line in drawn:
            assert line.strip() in statement, (name, line)
    assert "idle: 12 slots of 27 x 4; 1F1B leaves 36" in text


# --- hand-made records ---------------------------------------------------------------------------------------------

CASE = {"index": 0, "num_microbatches": 4, "rows": 4}


def record(tokens: list[str], peak: int, *, rank: int | None = None, rows: int = 4, case: dict = CASE,
           grads=None, returned=None, extra=()) -> dict:
    """A rank's step from tokens: "F3"/"B3"/"W3" passes, ">F3" an activation sent down, "<B3" a gradient sent up."""
    events = []
    for token in tokens:
        if token[0] in "FBW":
            events.append({"op": token[0], "mb": int(token[1:]), "rows": rows if token[0] == "F" else 0})
        elif rank is not None:
            link, peer = (rank, rank + 1) if token[0] == ">" else (rank - 1, rank - 1)
            events.append({"op": "isend", "peer": peer, "bytes": ref.activation_bytes(case, link)})
    return {"events": events + list(extra), "peak_live": peak, "grads": grads or {},
            "returned": returned or {"type": "NoneType", "value": None}}


def zb_records(world_size: int, case: dict = CASE) -> list[dict]:
    runs = ref.expected_runs(world_size, case["num_microbatches"])["zb-h1"]
    return [record(tokens, world_size, rank=r, case=case) for r, tokens in enumerate(runs)]


def decided(check, records, world_size=2, case=CASE, *args):
    g = grading(world_size)
    check(g, case, records, *args, world_size)
    return next(iter(verdicts(g).values()))


def test_zb_h1_records_pass_order_bubble_memory_and_messages():
    for world_size in (2, 3, 4):
        records = zb_records(world_size)
        for check in (ex.check_order, ex.check_bubble, ex.check_memory, ex.check_micro_batches, ex.check_messages):
            assert decided(check, records, world_size) == ("pass", ""), check.__name__


def test_1f1b_fails_order_and_bubble_and_says_so():
    runs = ref.expected_runs(3, 4)["1f1b"]
    records = [record(tokens, 3 - r, rank=r) for r, tokens in enumerate(runs)]
    status, message = decided(ex.check_order, records, 3)
    assert status == "fail" and "rank 1 ran" in message and "as 1F1B's one backward" in message
    status, message = decided(ex.check_bubble, records, 3)
    assert status == "fail" and "leaves 18 idle slots" in message and "1F1B leaves 18" in message
    assert "ZB-H1 a third of that, 6" in message and "rank 1 sent the gradient of micro-batch 0's input only after W0" \
        in message
    assert decided(ex.check_memory, records, 3)[0] == "pass"


def test_every_w_past_the_flush_fails_order_and_memory():
    m = CASE["num_microbatches"]
    rows = []
    for r in range(2):
        order = [t for t in ref.zb_h1_order(r, 2, m) if t[0] != "W"] + [f"W{i}" for i in range(m)]
        rows.append(record(ref.with_sends(order, r, 2, fused=False), m, rank=r))
    status, message = decided(ex.check_order, rows)
    assert status == "fail" and "past the flush" in message
    status, message = decided(ex.check_memory, rows)
    assert status == "fail" and "rank 0 held the saved activations of 4 micro-batches" in message


def test_w_newest_first_fails_order_only():
    rows = []
    for r in range(3):
        order, waiting = [], []
        for label in ref.zb_h1_order(r, 3, 6):
            if label[0] == "B":
                waiting.append(label[1:])
            order.append("W" + waiting.pop() if label[0] == "W" else label)
        rows.append(record(ref.with_sends(order, r, 3, fused=False), 3, rank=r, case={**CASE, "num_microbatches": 6}))
    case = {**CASE, "num_microbatches": 6}
    status, message = decided(ex.check_order, rows, 3, case)
    assert status == "fail" and "newest first" in message
    assert decided(ex.check_bubble, rows, 3, case)[0] == "pass"


def test_a_gradient_sent_after_the_next_pass_fails_the_bubble_and_names_the_send():
    records = zb_records(3)
    tokens = ref.expected_runs(3, 4)["zb-h1"]
    late = list(tokens[2])
    i = late.index("<B0")
    late[i], late[i + 1] = late[i + 1], late[i]  # the gradient of B0 goes after the forward that follows
    records[2] = record(late, 3, rank=2)
    status, message = decided(ex.check_bubble, records, 3)
    assert status == "fail" and "rank 2 sent the gradient of micro-batch 0's input only after F1" in message
    assert decided(ex.check_order, records, 3)[0] == "pass"


def test_a_message_never_sent_does_not_fit():
    records = zb_records(2)
    records[0] = record([t for t in ref.expected_runs(2, 4)["zb-h1"][0] if t != ">F3"], 2, rank=0)
    status, message = decided(ex.check_bubble, records)
    assert status == "fail" and "do not fit together" in message


def test_micro_batches_names_missing_and_repeated_weight_passes():
    records = zb_records(2)
    records[1] = record([t for t in ref.expected_runs(2, 4)["zb-h1"][1] if t != "W3"], 2, rank=1)
    status, message = decided(ex.check_micro_batches, records)
    assert status == "fail" and "3 of the 4 micro-batches" in message and "none for [3]" in message

    records = zb_records(2)
    records[1] = record(ref.expected_runs(2, 4)["zb-h1"][1] + ["W2"], 2, rank=1)
    status, message = decided(ex.check_micro_batches, records)
    assert status == "fail" and "more than once for [2]" in message

    records = zb_records(2)
    records[0] = record(["F0", "B0", "W0"], 1, rank=0, rows=16)
    status, message = decided(ex.check_micro_batches, records)
    assert status == "fail" and "forward 1 time(s), on 16 row(s)" in message


def test_messages_name_a_collective_a_far_peer_and_a_cast():
    records = zb_records(3)
    records[2]["events"].append({"op": "broadcast", "peer": None, "bytes": 8})
    status, message = decided(ex.check_messages, records, 3)
    assert status == "fail" and "rank 2 called dist.broadcast" in message

    records = zb_records(3)
    records[0]["events"].append({"op": "isend", "peer": 2, "bytes": 8})
    status, message = decided(ex.check_messages, records, 3)
    assert status == "fail" and "rank 0 sent to rank 2" in message

    records = zb_records(2)
    for e in records[0]["events"]:
        if e["op"] == "isend":
            e["bytes"] //= 2  # float32 on the wire
    status, message = decided(ex.check_messages, records)
    assert status == "fail" and "float64" in message and "rank 0 sent rank 1 4 x 1024 bytes" in message


def test_loss_and_gradients_against_the_whole_model():
    grads, loss = ref.expected_step(7, CASE, 2)
    ok = {"type": "float", "value": loss}
    rows = [record([], 2, grads=grads[0]), record([], 2, grads=grads[1], returned=ok)]
    assert decided(ex.check_loss, rows, 2, CASE, loss)[0] == "pass"
    assert decided(ex.check_gradients, rows, 2, CASE, grads)[0] == "pass"

    summed = [rows[0], record([], 2, returned={"type": "float", "value": 4 * loss})]
    status, message = decided(ex.check_loss, summed, 2, CASE, loss)
    assert status == "fail" and "sum of the micro-batch losses" in message

    for factor, words in ((4, "4 times too large"), (2, "twice the gradient"), (0.75, "some micro-batch's W never ran")):
        scaled = [record([], 2, grads={k: factor * v for k, v in stage.items()}) for stage in grads]
        status, message = decided(ex.check_gradients, scaled, 2, CASE, grads)
        assert status == "fail" and "on rank 1" in message and words in message, (factor, message)

    nearly = [record([], 2, grads={k: v * (1 + 1e-13) for k, v in stage.items()}) for stage in grads]
    assert decided(ex.check_gradients, nearly, 2, CASE, grads)[0] == "pass"  # the sums' order: within 1e-10


def test_a_record_the_submission_changed_is_unreadable():
    good = {"steps": [{"returned": {"type": "NoneType", "value": None}, "grads": {}, "events": [], "peak_live": 1}]}
    assert ex.read_steps(good, 1)[0]["peak_live"] == 1
    for bad in (None, {"steps": "x"}, {"steps": []}, {"steps": [{"returned": 3}]},
                {"steps": [{**good["steps"][0], "peak_live": "many"}]}):
        with pytest.raises(ex.Unreadable):
            ex.read_steps(bad, 1)
    odd = {"steps": [{**good["steps"][0], "events": [7, {"op": "F", "mb": "0"}, {"op": "B", "mb": 0}]}]}
    assert ex.read_steps(odd, 1)[0]["events"] == [{"op": "B", "mb": 0, "rows": 0}]


# --- the observed stage, in this process ---------------------------------------------------------------------------


def observed(split: str, m: int = 3) -> tuple[list[str], int]:
    """Run a middle stage through F0..F(m-1) then each micro-batch's backward, split as ``split`` says."""
    events: list = []
    stage = driver.ObservedStage(driver.build_stages(5, 3)[1], events)
    params = list(stage.parameters())
    xs = [torch.randn(2, driver.WIDTHS[1], dtype=torch.float64, requires_grad=True) for _ in range(m)]
    with torch.no_grad():
        stage(xs[0])  # without gradients: not a pass of the schedule
    outputs = [stage(x) for x in xs]
    grads = [torch.randn_like(y) for y in outputs]
    if split == "fused":
        for y, g in zip(outputs, grads):
            y.backward(g)
    elif split == "backward-inputs":
        for x, y, g in zip(xs, outputs, grads):
            y.backward(g, inputs=[x], retain_graph=True)
        for y, g in zip(outputs, grads):
            y.backward(g, inputs=params)
    elif split == "autograd-grad":
        for x, y, g in zip(xs, outputs, grads):
            torch.autograd.grad(y, x, g, retain_graph=True)
        for y, g in reversed(list(zip(outputs, grads))):
            torch.autograd.grad(y, params, g)
    labels = [f"{e['op']}{e['mb']}" for e in events if e["op"] != "f"]
    return labels, stage.peak_live


def test_observed_stage_sees_b_and_w_however_autograd_is_asked():
    assert observed("fused") == (["F0", "F1", "F2", "B0", "W0", "B1", "W1", "B2", "W2"], 3)
    assert observed("backward-inputs") == (["F0", "F1", "F2", "B0", "B1", "B2", "W0", "W1", "W2"], 3)
    assert observed("autograd-grad")[0] == ["F0", "F1", "F2", "B0", "B1", "B2", "W2", "W1", "W0"]


def test_observed_stage_sees_w_on_detached_copies_and_frees_a_micro_batch_at_its_w():
    events: list = []
    stage = driver.ObservedStage(driver.build_stages(5, 2)[0], events)
    named = dict(stage.named_parameters())
    for k in range(3):  # one micro-batch alive at a time: F, B, W
        copies = {n: p.detach().requires_grad_() for n, p in named.items()}
        x = torch.randn(2, driver.WIDTHS[0], dtype=torch.float64)
        y = torch.func.functional_call(stage, copies, (x,))
        g = torch.randn_like(y)
        torch.autograd.grad(y, list(copies.values()), g)
    assert [f"{e['op']}{e['mb']}" for e in events] == ["F0", "B0", "W0", "F1", "B1", "W1", "F2", "B2", "W2"]
    assert stage.peak_live == 1


def test_retain_graph_in_w_keeps_every_micro_batch_alive():
    events: list = []
    stage = driver.ObservedStage(driver.build_stages(5, 2)[0], events)
    params = list(stage.parameters())
    kept = []
    for k in range(3):
        y = stage(torch.randn(2, driver.WIDTHS[0], dtype=torch.float64))
        y.backward(torch.ones_like(y), inputs=params, retain_graph=True)
        kept.append(y)
    assert stage.peak_live == 3
