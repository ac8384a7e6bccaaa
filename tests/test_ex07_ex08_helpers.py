"""Pure helpers of the checks of exercises 07 and 08 (no process group; fast)."""

from __future__ import annotations

import torch

from grader.checks import ex07_ring_allreduce as ex07
from grader.checks import ex08_bucketed as ex08


def test_drawn_cases_are_the_same_every_time_and_cover_every_dtype():
    first, second = ex07.drawn_cases(), ex07.drawn_cases()
    assert first == second
    cases = ex07.cases_for(4, first)
    assert {c["dtype"] for c in cases} == set(ex07.DTYPES)
    assert sum(c["measure"] for c in cases) == 1


def test_fixed_cases_include_the_awkward_sizes():
    for world_size in (2, 3, 4):
        numels = [torch.Size(c["shape"]).numel() for c in ex07.fixed_cases(world_size)]
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
