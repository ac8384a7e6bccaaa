"""Pure helpers of the checks of exercises 07 and 08 (no process group; fast)."""

from __future__ import annotations

import torch

from grader.checks import ex07_ring_allreduce as ex07
from grader.rank.drivers import ex07_ring_allreduce as ex07_rank
from grader.checks import ex08_bucketed as ex08


def test_drawn_cases_are_the_same_every_time_and_cover_every_dtype():
    first, second = ex07.drawn_cases(), ex07.drawn_cases()
    assert first == second
    cases = ex07.cases_for(4, first)
    assert {c["dtype"] for c in cases} == set(ex07.DTYPES)
    assert sum(c["measure"] for c in cases) == 1


def test_fixed_cases_include_the_awkward_sizes():
    for world_size in (2, 3, 4):
        numels = [torch.Size(c["shape"]).numel() for c in ex07_rank.fixed_cases(world_size)]
        assert any(n < world_size for n in numels)
        assert any(n % world_size for n in numels)
        assert ex07.BIG_NUMEL % world_size == 0


def test_rank_tensors_are_seeded_and_differ_between_ranks():
    case = {"shape": [3, 5], "dtype": "int64", "seed": 3}
    assert torch.equal(ex07.make_tensor(case, 1), ex07.make_tensor(case, 1))
    assert not torch.equal(ex07.make_tensor(case, 0), ex07.make_tensor(case, 1))


def test_compare_is_exact_for_int64_and_names_the_first_wrong_element():
    case = {"shape": [2, 3], "dtype": "int64", "seed": 1}
    expected = ex07.expected_sum(case, 3)
    assert ex07.compare(expected.clone(), expected, case) is None
    wrong = expected.clone()
    wrong[1, 2] += 1
    message = ex07.compare(wrong, expected, case)
    assert "1 of 6" in message and "(1, 2)" in message


def test_compare_tolerates_float_rounding_only():
    case = {"shape": [50], "dtype": "float32", "seed": 2}
    expected = ex07.expected_sum(case, 4)
    assert ex07.compare(expected.to(torch.float32), expected, case) is None
    assert ex07.compare((expected * 1.001).to(torch.float32), expected, case) is not None


def test_bucket_layouts_follow_the_cap_rules():
    # trainable sizes, in registration order: fc1.weight 768, fc1.bias 96, fc2.weight 3072,
    # fc2.bias 128, fc3.weight 512, fc3.bias 16 (bytes)
    assert ex08.expected_buckets(656) == [["fc3.bias", "fc3.weight", "fc2.bias"], ["fc2.weight"],
                                          ["fc1.bias"], ["fc1.weight"]]  # 16 + 512 + 128 = 656 fits exactly
    assert ex08.expected_buckets(3200) == [["fc3.bias", "fc3.weight", "fc2.bias"], ["fc2.weight", "fc1.bias"],
                                           ["fc1.weight"]]
    assert ex08.expected_buckets(25 * 2**20) == [["fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight",
                                                  "fc1.bias", "fc1.weight"]]
    assert all(len(b) == 1 for b in ex08.expected_buckets(100))  # each larger than the cap, or alone
    assert not any("frozen" in n for b in ex08.expected_buckets(25 * 2**20) for n in b)


def test_each_layout_cap_tells_a_common_mistake_apart():
    def layout(cap, reverse=True, closes_at_cap=False):
        params = [(n, p.numel() * 4) for n, p in ex08.Net().named_parameters() if p.requires_grad]
        buckets, bucket, size = [], [], 0
        for name, nbytes in (reversed(params) if reverse else params):
            if bucket and (size + nbytes >= cap if closes_at_cap else size + nbytes > cap):
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(name)
            size += nbytes
        return buckets + [bucket]

    def contents(buckets):
        return sorted(sorted(b) for b in buckets)

    caps = ex08.LAYOUT_CAPS_BYTES
    # forward order gives other groups, not only the same groups listed the other way round
    assert any(contents(layout(c, reverse=False)) != contents(ex08.expected_buckets(c)) for c in caps)
    assert any(layout(c, closes_at_cap=True) != ex08.expected_buckets(c) for c in caps)
    assert any(layout(c / 2**20 * 1e6) != ex08.expected_buckets(c) for c in caps)  # MB taken for MiB
    # the float64 model: four bytes per element, whatever the dtype, gives other buckets
    assert any(layout(c) != ex08.expected_buckets(c, "float64") for c in caps)


def test_the_dtype_plans_give_the_dtypes_they_name():
    assert {p.dtype for p in ex08.build_model(0, "float64").parameters()} == {torch.float64}
    mixed = {n: p.dtype for n, p in ex08.build_model(0, "mixed").named_parameters()}
    assert mixed["fc2.weight"] == mixed["fc2.bias"] == torch.float64 and mixed["fc1.weight"] == torch.float32
    # with the training cap a bucket holds float32 and float64 gradients together
    layout = ex08.expected_buckets(ex08.TRAIN_CAP_BYTES, "mixed")
    assert any({mixed[n] for n in bucket} == {torch.float32, torch.float64} for bucket in layout)


# --- ring-neighbours and ring-bytes on what the kernel counted (grader.traffic.RunTraffic) -----------------------

from grader.traffic import RunTraffic  # noqa: E402
from grading_helpers import grading_for, verdicts  # noqa: E402

grading = grading_for("07")


def ring_run(world_size: int, cases: list[dict]) -> tuple[list[dict], RunTraffic]:
    """What a right ring records of itself and what the kernel counts of it: each rank sends its next rank
    2 (W - 1) / W of every tensor plus gloo's headers, and its previous rank the receives' notifications."""
    records = [{"cases": [{"result": None, "returned": "NoneType", "events": [
        {"op": "isend", "peer": (rank + 1) % world_size, "bytes": ex07.case_bytes(case) // world_size}
        for _ in range(2 * (world_size - 1))] + [
        {"op": "irecv", "peer": (rank - 1) % world_size, "bytes": ex07.case_bytes(case) // world_size}
        for _ in range(2 * (world_size - 1))]} for case in cases]} for rank in range(world_size)]
    messages = 2 * (world_size - 1) * len(cases)
    sent = {}
    for rank in range(world_size):
        sent[(rank, (rank + 1) % world_size)] = int(ex07.ring_bytes(cases, world_size)) + 96 * messages + 9
        sent[(rank, (rank - 1) % world_size)] = sent.get((rank, (rank - 1) % world_size), 0) + 48 * messages + 1
        for other in range(world_size):
            sent.setdefault((rank, other), 1) if other != rank else None
    return records, RunTraffic(world_size, sent, 0, set(range(world_size)))


CASES = ex07.cases_for(4, [])


def test_a_ring_the_kernel_counted_passes_on_the_kernels_count():
    g = grading(4)
    records, counted = ring_run(4, CASES)
    ex07.check_neighbours(g, records, 4, counted)
    ex07.check_bytes(g, CASES, records, 4, counted)
    assert verdicts(g) == {"ring-neighbours": ("pass", ""), "ring-bytes": ("pass", "")}
    assert {c.id: c.evidence for c in g.results(None) if c.status == "pass"} == \
        {"ring-neighbours": "kernel", "ring-bytes": "kernel"}


def test_a_record_of_a_ring_without_its_bytes_fails_ring_bytes():
    """The forged ring: the right record, and next to nothing on the wire (what tests/hostile/07_forges_the_ring
    does for real)."""
    g = grading(4)
    records, counted = ring_run(4, CASES)
    counted.sent = {key: 9 for key in counted.sent}
    ex07.check_bytes(g, CASES, records, 4, counted)
    status, message = verdicts(g)["ring-bytes"]
    assert status == "fail" and "rank 0 sent the other ranks 27 bytes (the kernel's count" in message


def test_bytes_on_a_link_outside_the_ring_fail_ring_neighbours_whatever_the_record_says():
    g = grading(4)
    records, counted = ring_run(4, CASES)
    counted.sent[(0, 2)] = ex07.BIG_NUMEL * 4 // 4  # one chunk of the measured tensor, straight across
    ex07.check_neighbours(g, records, 4, counted)
    status, message = verdicts(g)["ring-neighbours"]
    assert status == "fail" and "rank 0 sent rank 2 60,540 bytes (the kernel's count)" in message
    control = grading(4)
    records, counted = ring_run(4, CASES)
    counted.sent[(0, 2)] = 48 * 2 * 3 * len(CASES)  # receive notifications, as gloo sends them to any source
    ex07.check_neighbours(control, records, 4, counted)
    assert verdicts(control)["ring-neighbours"][0] == "pass"


def test_a_rank_whose_sockets_were_never_read_fails_both():
    g = grading(4)
    records, counted = ring_run(4, CASES)
    counted.counted = {0, 1, 3}
    ex07.check_neighbours(g, records, 4, counted)
    ex07.check_bytes(g, CASES, records, 4, counted)
    got = verdicts(g)
    assert all(got[c][0] == "fail" and "rank 2's connections were never counted" in got[c][1]
               for c in ("ring-neighbours", "ring-bytes"))


def test_a_call_outside_the_ring_is_named_from_the_record_and_the_failure_says_it_stood_on_a_claim():
    g = grading(4)
    records, counted = ring_run(4, CASES)
    records[1]["cases"][0]["events"].append({"op": "send", "peer": 3, "bytes": 16})
    ex07.check_neighbours(g, records, 4, counted)
    (verdict,) = [c for c in g.results(None) if c.id == "ring-neighbours"]
    assert verdict.status == "fail" and "rank 1 sent to rank 3 (dist.send)" in verdict.message
    assert verdict.evidence == "claim"


def test_where_the_kernel_cannot_be_read_the_record_decides_and_says_so():
    g = grading(4)
    records, _ = ring_run(4, CASES)
    ex07.check_neighbours(g, records, 4, None)
    ex07.check_bytes(g, CASES, records, 4, None)
    assert {c.id: (c.status, c.evidence) for c in g.results(None) if c.status != "error"} == \
        {"ring-neighbours": ("pass", "claim"), "ring-bytes": ("pass", "claim")}


def test_a_case_that_raised_leaves_the_cases_before_it_counted():
    g = grading(4)
    records, counted = ring_run(4, CASES[:3])  # the scalar case (index 2) raised on every rank
    for record in records:
        record["cases"][2] = {"error": {"type": "IndexError", "message": "", "at": 0.0}, "events": []}
    ex07.check_bytes(g, CASES, records, 4, counted)
    assert verdicts(g)["ring-bytes"][0] == "pass"
