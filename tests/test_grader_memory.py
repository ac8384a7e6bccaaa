"""grader.rank.memory: the tensors an object keeps, the storages behind them, and values found in them."""

from __future__ import annotations

import types

import torch

from grader.rank import memory


def test_reachable_tensors_follows_attributes_containers_hooks_closures_and_grads():
    module = torch.nn.Linear(3, 2)
    kept_in_list = torch.ones(5)
    in_closure = torch.ones(7)
    module.cache = {"parts": [kept_in_list]}
    module.register_forward_hook(lambda m, args, out: in_closure.sum())
    module.weight.grad = torch.ones(2, 3)
    found = {id(t) for t in memory.reachable_tensors([module], "nobody")}
    for tensor in (module.weight, module.bias, kept_in_list, in_closure, module.weight.grad):
        assert id(tensor) in found


def test_reachable_tensors_enters_the_learners_namespace_and_no_other():
    learner = types.ModuleType("learner_file")
    exec("import torch\nHIDDEN = torch.ones(11)\ndef hook(*args):\n    return HIDDEN\n", learner.__dict__)
    other = types.ModuleType("someone_else")
    exec("import torch\nHIDDEN = torch.ones(13)\ndef hook(*args):\n    return HIDDEN\n", other.__dict__)
    holder = torch.nn.Module()
    holder.hooks = [learner.hook, other.hook]
    sizes = {t.numel() for t in memory.reachable_tensors([holder], "learner_file")}
    assert 11 in sizes and 13 not in sizes


def test_a_storage_counts_once_and_a_freed_one_not_at_all():
    flat = torch.zeros(10)
    views = [flat[:4], flat[4:].view(2, 3)]
    freed = torch.zeros(100)
    freed.untyped_storage().resize_(0)
    storages = memory.distinct_storages(views + [flat, freed])
    assert list(s.nbytes() for s in storages.values()) == [40]
    assert memory.held_bytes([{"a": views, "b": freed}], "nobody") == 40


def test_reading_a_storage_leaves_it_resizable():
    t = torch.arange(4, dtype=torch.float32)
    raw = memory.storage_bytes(t.untyped_storage())
    assert raw == t.clone().numpy().tobytes()
    t.untyped_storage().resize_(0)  # numpy() on the tensor itself would forbid this


def test_values_are_found_inside_a_larger_buffer_but_not_from_half_of_them():
    weight = torch.randn(4, 4)
    flat = torch.cat([torch.randn(3), weight.reshape(-1), torch.zeros(5)])
    half = flat[3:11].clone()
    fingerprints = {"unit": memory.tensor_bytes(weight)}
    assert memory.found_in([memory.storage_bytes(flat.untyped_storage())], fingerprints) == ["unit"]
    assert memory.found_in([memory.storage_bytes(half.untyped_storage())], fingerprints) == []


def test_saved_tensors_are_seen_until_their_storage_is_freed():
    flat = torch.randn(12, requires_grad=True)
    weight = flat[:8].view(2, 4)
    x = torch.randn(3, 4, requires_grad=True)
    refs: list = []
    with memory.watch_saved(refs):
        y = torch.nn.functional.linear(x, weight)
    assert flat.untyped_storage().data_ptr() in memory.saved_storages(refs)
    flat.data.untyped_storage().resize_(0)
    assert flat.untyped_storage().data_ptr() not in memory.saved_storages(refs)
    assert x.untyped_storage().data_ptr() in memory.saved_storages(refs)  # saved for the weight's gradient
    del y, x  # the graph and the input go: nothing saved is left
    assert memory.saved_storages(refs) == {}
