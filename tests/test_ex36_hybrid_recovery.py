"""Exercise 36's verdicts, from hand-made records (no processes started)."""

from __future__ import annotations

import torch
from grading_helpers import grading_for
from grading_helpers import verdicts as decided

from grader.checks.ex36_hybrid_recovery import verdicts
from grader.checks.shared import mismatch
from grader.rank.drivers.shared.recording import MessageJournal, journal_name
from grader.rank.drivers.ex36_hybrid_recovery import STEPS_BEFORE, layout
from grader.checks.ex36_hybrid_recovery.reference import (held_limit, local_shape, reference_run, shapes,
                                                          unit_elements)
from grader.grading import Grading
from grader.rank.outcomes import RankOutcome, WorldOutcome

REFERENCES = {world_size: reference_run(world_size) for world_size in (4, 2)}
grading = grading_for("36", 4)


def statuses(g: Grading) -> dict:
    return {check: status for check, (status, _) in decided(g).items()}


def messages(g: Grading) -> dict:
    return {check: message for check, (_, message) in decided(g).items()}


def chunk(full: torch.Tensor, shards: int, shard: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.chunk(full, shards, dim=0)[shard].to(dtype).clone()


def state_of(params: dict, shards: int, shard: int, dtype: torch.dtype, step: float, seed: int) -> dict:
    """A rank's state: its rows of ``params`` and AdamW moments made up from ``seed`` (the same for a shard in
    every replica)."""
    generator = torch.Generator().manual_seed(seed)
    own = {name: chunk(full, shards, shard, dtype) for name, full in params.items()}
    state = {}
    for name, full in params.items():
        moments = [torch.randn(full.shape, generator=generator, dtype=torch.float64) for _ in range(2)]
        state[name] = {"exp_avg": chunk(moments[0], shards, shard, dtype),
                       "exp_avg_sq": chunk(moments[1].abs(), shards, shard, dtype),
                       "step": torch.tensor(step, dtype=torch.float32)}
    return {"params": own, "state": state}


def step_events(rank: int, plan: dict, itemsize: int) -> list[dict]:
    """What FSDP2 runs in one step on the 2-D mesh: an all-gather of each unit in forward (the root first),
    the blocks again in backward, then a reduce-scatter and an all-reduce of each unit."""
    shards = plan["shards"]
    row = verdicts.replica_ranks(plan, rank // shards)
    column = verdicts.shard_ranks(plan, rank % shards)
    units = unit_elements(shards)
    sizes = [units["root"]] + units["blocks"]
    gather = lambda n: {"op": "all_gather_single", "group": row, "bytes": n * itemsize}  # noqa: E731
    events = [gather(n) for n in sizes] + [{"op": "mark", "what": "forward-returned", "group": None, "bytes": 0}]
    events += [gather(n) for n in reversed(units["blocks"])]
    for n in reversed(sizes):
        events.append({"op": "reduce_scatter_single", "group": row, "bytes": n * shards * itemsize})
        events.append({"op": "all_reduce", "group": column, "bytes": n * itemsize})
    if shards == 1:  # one shard: FSDP2 gathers and reduce-scatters nothing
        events = [e for e in events if e["op"] in ("mark", "all_reduce")]
    return events


def messages_of(rank: int, plan: dict, state: dict) -> list[dict]:
    """The recovery's messages: the source sends each local tensor to the same shard of every wiped replica."""
    shards, source = plan["shards"], plan["source"]
    tensors = []
    for name, value in state["params"].items():
        tensors += [value] + [state["state"][name][k] for k in ("exp_avg", "exp_avg_sq", "step")]
    if rank // shards == source:
        return [{"op": "c10d.send.default", "bytes": t.numel() * t.element_size(), "group": None,
                 "peer": r * shards + rank % shards, "dtype": str(t.dtype)} for r in plan["wiped"] for t in tensors]
    return [{"op": "c10d.recv_.default", "bytes": t.numel() * t.element_size(), "group": None,
             "peer": source * shards + rank % shards, "dtype": str(t.dtype)} for t in tensors]


def right_observations(world_size: int) -> list[dict]:
    plan = layout(world_size)
    shards, dtype = plan["shards"], getattr(torch, plan["dtype"])
    itemsize = torch.empty(0, dtype=dtype).element_size()
    reference = REFERENCES[world_size]
    observations = []
    for rank in range(world_size):
        shard = rank % shards
        before = state_of(reference["states"][STEPS_BEFORE - 1], shards, shard, dtype, STEPS_BEFORE, 10 + shard)
        replay = state_of(reference["states"][-1], shards, shard, dtype, STEPS_BEFORE + 2, 20 + shard)
        observations.append({
            "returned": None, "error": None, "wiped": rank // shards in plan["wiped"],
            "mesh": {"type": "DeviceMesh", "device_type": "cpu", "shape": [plan["replicas"], shards],
                     "names": ["replicate", "shard"],
                     "layout": [verdicts.replica_ranks(plan, r) for r in range(plan["replicas"])]},
            "params": {name: {"dtensor": True, "placements": ["Replicate()", "Shard(dim=0)"],
                              "mesh_shape": [plan["replicas"], shards],
                              "local_shape": local_shape(shape, shards, shard)}
                       for name, shape in shapes().items()},
            "held": [{"when": "after shard_hybrid", "bytes": held_limit(shards, itemsize, False), "whole": []},
                     {"when": f"after step {STEPS_BEFORE}", "bytes": held_limit(shards, itemsize, True), "whole": []}],
            "steps": [{"events": step_events(rank, plan, itemsize),
                       "params": {n: chunk(full, shards, shard, dtype)
                                  for n, full in reference["states"][step].items()}}
                      for step in range(STEPS_BEFORE)],
            "before": before, "replay": replay, "after": before, "resumed": replay,
            "recovery": {"events": messages_of(rank, plan, before), "writes": [], "saves": [], "held": [],
                         "error": None},
        })
    return observations


def grade_all(observations: list[dict], world_size: int) -> Grading:
    """Every verdict, in the order grade() calls them."""
    plan = layout(world_size)
    itemsize = torch.empty(0, dtype=getattr(torch, plan["dtype"])).element_size()
    g = grading(world_size)
    verdicts.check_mesh(g, observations, world_size, plan, "cpu")
    verdicts.check_placements(g, observations, world_size, plan, shapes())
    if plan["shards"] > 1:
        verdicts.check_units(g, observations, world_size, plan, unit_elements(plan["shards"]), itemsize)
    verdicts.check_groups(g, observations, world_size, plan)
    verdicts.check_training(g, observations, world_size, plan, REFERENCES[world_size])
    verdicts.check_recovered(g, observations, world_size, plan)
    verdicts.check_resumed(g, observations, world_size, plan)
    if verdicts.check_messages(g, observations, world_size, plan):
        verdicts.check_bytes(g, observations, world_size, plan)
    else:
        g.not_checked("recovery-bytes", "peer-messages", "not point to point", world_size=world_size)
    verdicts.check_held(g, observations, world_size, plan, itemsize)
    return g


def test_right_records_pass_every_check():
    for world_size in (4, 2):
        observations = right_observations(world_size)
        assert all(verdicts.readable(obs) for obs in observations)
        got = statuses(grade_all(observations, world_size))
        assert set(got.values()) == {"pass"}, (world_size, got)
        assert len(got) == (10 if world_size == 4 else 9)


def test_mesh_dimensions_named_the_other_way_round_are_named():
    observations = right_observations(4)
    observations[1]["mesh"]["names"] = ["shard", "replicate"]
    g = grade_all(observations, 4)
    said = messages(g)["mesh"]
    assert statuses(g)["mesh"] == "fail" and "rank 1" in said and "['shard', 'replicate']" in said


def test_replicas_as_the_inner_dimension_fail_the_mesh_and_the_groups():
    observations = right_observations(4)
    for rank, obs in enumerate(observations):
        obs["mesh"]["layout"] = [[0, 2], [1, 3]]
        obs["steps"][0]["events"][0]["group"] = [0, 2] if rank % 2 == 0 else [1, 3]
    g = grade_all(observations, 4)
    got, said = statuses(g), messages(g)
    assert got["mesh"] == "fail" and "row of neighbouring ranks ([[0, 1], [2, 3]])" in said["mesh"]
    assert got["collective-groups"] == "fail"
    assert "all_gather_single of 5616 bytes ran among ranks [0, 2]" in said["collective-groups"]


def test_a_one_dimensional_placement_is_named_with_its_mesh():
    observations = right_observations(4)
    observations[2]["params"]["blocks.0.up.weight"].update(placements=["Shard(dim=0)"], mesh_shape=[4])
    g = grade_all(observations, 4)
    said = messages(g)["hybrid-placements"]
    assert "rank 2: 'blocks.0.up.weight' is placed (Shard(dim=0)) on a mesh of shape [4]" in said


def test_a_plain_parameter_and_a_wrong_local_shape_fail_the_placements():
    observations = right_observations(4)
    observations[0]["params"]["head.bias"]["dtensor"] = False
    assert "'head.bias' is a plain tensor" in messages(grade_all(observations, 4))["hybrid-placements"]
    observations = right_observations(4)
    observations[3]["params"]["embed.weight"]["local_shape"] = [48, 16]
    said = messages(grade_all(observations, 4))["hybrid-placements"]
    assert "rank 3" in said and "[48, 16]" in said and "[24, 16]" in said


def test_the_root_alone_as_one_unit_is_named():
    observations = right_observations(4)
    plan, units = layout(4), unit_elements(2)
    whole = (sum(units["blocks"]) + units["root"]) * 8
    for rank, obs in enumerate(observations):
        row = verdicts.replica_ranks(plan, rank // 2)
        obs["steps"][0]["events"][:3] = [{"op": "all_gather_single", "group": row, "bytes": whole}]
    g = grade_all(observations, 4)
    assert statuses(g)["block-units"] == "fail" and "only the root" in messages(g)["block-units"]


def test_no_all_reduce_across_replicas_fails_the_groups():
    observations = right_observations(4)
    for obs in observations:
        obs["steps"][1]["events"] = [e for e in obs["steps"][1]["events"] if e["op"] != "all_reduce"]
    g = grade_all(observations, 4)
    said = messages(g)["collective-groups"]
    assert statuses(g)["collective-groups"] == "fail" and "step 2" in said and "no all-reduce" in said


def test_an_all_reduce_over_the_world_fails_the_groups():
    observations = right_observations(4)
    observations[0]["steps"][0]["events"][-1]["group"] = [0, 1, 2, 3]
    said = messages(grade_all(observations, 4))["collective-groups"]
    assert "ran among ranks [0, 1, 2, 3]" in said and "shard 0, [0, 2]" in said


def test_a_copy_of_the_model_kept_beside_the_shards_fails_what_each_rank_holds():
    observations = right_observations(4)
    observations[1]["held"][0]["bytes"] += 162_528  # the whole model in float64
    g = grade_all(observations, 4)
    said = messages(g)["holds-one-over-shards"]
    assert statuses(g)["holds-one-over-shards"] == "fail" and "rank 1, after shard_hybrid" in said


def test_a_whole_tensor_found_in_the_recovery_is_named():
    observations = right_observations(4)
    observations[2]["recovery"]["held"] = [{"when": "after all_gather_into_tensor", "bytes": 0,
                                            "whole": ["embed.weight.exp_avg"]}]
    said = messages(grade_all(observations, 4))["holds-one-over-shards"]
    assert "rank 2, after all_gather_into_tensor: held 'embed.weight.exp_avg' whole" in said


def test_training_off_the_single_process_replay_is_named():
    observations = right_observations(4)
    observations[3]["steps"][1]["params"]["head.weight"] += 1e-3
    g = grade_all(observations, 4)
    said = messages(g)["matches-single-process"]
    assert statuses(g)["matches-single-process"] == "fail" and "after step 2, rank 3: 'head.weight'" in said


def test_float32_rounding_is_within_the_tolerance():
    observations = right_observations(2)
    for obs in observations:
        for name, value in obs["steps"][0]["params"].items():
            value.add_(value.abs() * 2e-7)
    assert statuses(grade_all(observations, 2))["matches-single-process"] == "pass"


def test_a_step_count_left_at_zero_is_named():
    observations = right_observations(4)
    after = observations[0]["after"] = {"params": dict(observations[0]["before"]["params"]),
                                        "state": {n: dict(e) for n, e in observations[0]["before"]["state"].items()}}
    after["state"]["embed.weight"]["step"] = torch.tensor(0.0)
    g = grade_all(observations, 4)
    said = messages(g)["recovered-bitwise"]
    assert statuses(g)["recovered-bitwise"] == "fail"
    assert "rank 0 (wiped; shard 0 of replica 1 is rank 2)" in said and "step of 'embed.weight' is 0, not 2" in said


def test_one_bit_off_fails_and_minus_zero_is_not_zero():
    observations = right_observations(4)
    params = dict(observations[1]["before"]["params"])
    params["head.bias"] = params["head.bias"].clone()
    params["head.bias"][0] = torch.nextafter(params["head.bias"][0], torch.tensor(1.0, dtype=torch.float64))
    observations[1]["after"] = {"params": params, "state": observations[1]["before"]["state"]}
    assert "'head.bias' differs by up to" in messages(grade_all(observations, 4))["recovered-bitwise"]
    zero = torch.zeros(3, dtype=torch.float64)
    assert verdicts._same(-zero, zero, "x") is not None and verdicts._same(zero.clone(), zero, "x") is None


def test_a_source_overwritten_by_the_wiped_replica_is_named():
    observations = right_observations(4)
    observations[2]["after"] = state_of(REFERENCES[4]["initial"], 2, 0, torch.float64, 0.0, 99)  # the wiped values
    g = grade_all(observations, 4)
    said = messages(g)["recovered-bitwise"]
    assert statuses(g)["recovered-bitwise"] == "fail"
    assert said.startswith("rank 2 (replica 1, not wiped): after recover_from_peer 'embed.weight' differs")
    assert "must keep its own state" in said


def test_training_after_the_recovery_off_the_replay_is_named():
    observations = right_observations(4)
    resumed = {"params": dict(observations[0]["replay"]["params"]), "state": observations[0]["replay"]["state"]}
    resumed["params"]["blocks.1.norm.weight"] = resumed["params"]["blocks.1.norm.weight"] + 0.01
    observations[0]["resumed"] = resumed
    g = grade_all(observations, 4)
    said = messages(g)["training-resumes"]
    assert statuses(g)["training-resumes"] == "fail" and "rank 0 (wiped)" in said and "blocks.1.norm.weight" in said


def test_a_recovery_that_forgot_a_state_tensor_is_named_in_the_resumed_training():
    """The steps after a recovery that left exp_avg_sq (or a step count) at zero go elsewhere: the message names
    what the recovery left, not the parameters' storage."""
    for key, value in (("exp_avg_sq", None), ("step", torch.tensor(0.0))):
        observations = right_observations(2)
        wiped = observations[1]
        state = {n: dict(e) for n, e in wiped["before"]["state"].items()}
        state["head.bias"][key] = torch.zeros_like(state["head.bias"][key]) if value is None else value
        wiped["after"] = {"params": wiped["before"]["params"], "state": state}
        for obs in observations:  # every replica trains elsewhere: the all-reduce mixes the wiped one in
            obs["resumed"] = {"params": {n: t + 1e-3 for n, t in obs["replay"]["params"].items()},
                              "state": obs["replay"]["state"]}
        g = grade_all(observations, 2)
        said = messages(g)["training-resumes"]
        assert statuses(g)["training-resumes"] == "fail" and said.startswith("rank 0: after the steps")
        assert f"the recovery left rank 1 with a state other than its source's (the optimizer's {key} of " \
               "'head.bias'" in said and "in place" not in said


def test_a_broadcast_fails_the_messages_and_leaves_the_bytes_undecided():
    observations = right_observations(4)
    for rank, obs in enumerate(observations):
        obs["recovery"]["events"] = [{"op": "c10d.broadcast_.default", "bytes": 512,
                                      "group": [0, 2] if rank % 2 == 0 else [1, 3], "peer": None}]
    g = grade_all(observations, 4)
    got = statuses(g)
    assert got["peer-messages"] == "fail" and got["recovery-bytes"] == "not-checked"
    assert "broadcast_ of 512 bytes among ranks [0, 2]" in messages(g)["peer-messages"]


def test_a_collective_seen_only_through_the_python_api_fails_the_messages():
    observations = right_observations(4)
    observations[3]["recovery"]["collectives"] = [{"op": "all_gather_into_tensor", "via": "functional", "bytes": 256,
                                                   "group": [2, 3], "dtype": "float64"}]
    g = grade_all(observations, 4)
    said = messages(g)["peer-messages"]
    assert statuses(g)["peer-messages"] == "fail"
    assert "rank 3: recover_from_peer ran all_gather_into_tensor of 256 bytes among ranks [2, 3]" in said
    assert "a gather brings whole tensors" in said


def test_a_small_header_is_allowed():
    observations = right_observations(4)
    for rank, obs in enumerate(observations[2:], start=2):
        obs["recovery"]["events"].insert(0, {"op": "c10d.send.default", "bytes": 8, "peer": rank - 2})
    got = statuses(grade_all(observations, 4))
    assert got["peer-messages"] == "pass" and got["recovery-bytes"] == "pass"


def test_a_barrier_or_a_collective_of_a_few_bytes_fails_the_messages():
    """The statement allows no collective: a barrier stops every replica, what recovery from a peer avoids."""
    for op, size, words in (("c10d.barrier.default", 1, "a barrier is a collective"),
                            ("c10d.monitored_barrier_.default", 0, "a barrier is a collective"),
                            ("c10d.allreduce_.default", 4, "a collective makes every rank")):
        observations = right_observations(4)
        observations[3]["recovery"]["events"].append({"op": op, "bytes": size, "group": [0, 1, 2, 3]})
        g = grade_all(observations, 4)
        said = messages(g)["peer-messages"]
        assert statuses(g)["peer-messages"] == "fail" and said.startswith(f"rank 3: recover_from_peer ran {op[5:-8]}")
        assert words in said and statuses(g)["recovery-bytes"] == "not-checked"


def test_a_message_to_another_shard_and_a_file_fail_the_messages():
    observations = right_observations(4)
    observations[3]["recovery"]["events"][0]["peer"] = 0
    said = messages(grade_all(observations, 4))["peer-messages"]
    assert "rank 3: recover_from_peer sent 3072 bytes to rank 0" in said and "only with rank 1" in said
    observations = right_observations(4)
    observations[1]["recovery"]["writes"] = ["/tmp/recover-shard1.pt"]
    assert "opened '/tmp/recover-shard1.pt' for writing" in messages(grade_all(observations, 4))["peer-messages"]


def test_a_recovery_through_torch_save_is_named_before_what_the_wiped_ranks_missed():
    observations = right_observations(4)
    for obs in observations[:2]:
        obs["recovery"]["events"] = []  # the wiped replica received nothing: it read the file
    observations[3]["recovery"]["saves"] = ["/tmp/recover-shard1.pt"]
    said = messages(grade_all(observations, 4))["peer-messages"]
    assert said.startswith("rank 3: recover_from_peer torch.save wrote '/tmp/recover-shard1.pt'") and "no file" in said


def test_a_wiped_rank_that_sends_its_state_fails_the_messages():
    observations = right_observations(2)
    observations[1]["recovery"]["events"] = [dict(e, op="c10d.send.default") for e in
                                             observations[1]["recovery"]["events"]]
    said = messages(grade_all(observations, 2))["peer-messages"]
    assert "rank 1 (wiped) sent" in said and "to rank 0 of the source replica" in said


def test_one_step_number_for_every_parameter_passes_the_bytes_and_none_fails():
    """AdamW steps every parameter together: one number carries every step count (the decision the statement
    says); the moments and shards without any step count are too few."""
    observations = right_observations(4)
    for rank in (2, 3):
        events = observations[rank]["recovery"]["events"]
        steps = [e for e in events if e["bytes"] == 4]
        assert len(steps) == len(shapes())
        events[:] = [e for e in events if e["bytes"] != 4] + [dict(steps[0], bytes=8, dtype="int64")]
    assert statuses(grade_all(observations, 4))["recovery-bytes"] == "pass"
    for rank in (2, 3):
        observations[rank]["recovery"]["events"].pop()
    said = messages(grade_all(observations, 4))["recovery-bytes"]
    assert "rank 2 sent rank 0" in said and "no step count: send each parameter's step, or one step number" in said


def test_too_few_and_twice_the_bytes_are_named():
    observations = right_observations(4)
    observations[2]["recovery"]["events"] = observations[2]["recovery"]["events"][1:]  # no shard of embed.weight
    said = messages(grade_all(observations, 4))["recovery-bytes"]
    assert "rank 2 sent rank 0 240784 bytes" in said and "less than its state" in said
    observations = right_observations(4)
    observations[3]["recovery"]["events"] *= 2
    said = messages(grade_all(observations, 4))["recovery-bytes"]
    assert "rank 3 sent rank 1 487712 bytes" in said and "2 times its state" in said


def test_unreadable_records_are_refused():
    obs = right_observations(2)[0]
    readable = verdicts.readable
    assert not readable([1, 2])
    assert not readable(dict(obs, steps=[{"events": None, "params": {}}]))
    assert not readable(dict(obs, steps=[{"events": [{"op": "all_reduce", "bytes": "8"}], "params": {}}]))
    assert not readable(dict(obs, after={"params": {}, "state": {"x": 3}}))
    assert not readable(dict(obs, after={"params": {"w": [1.0]}, "state": {}}))
    assert not readable(dict(obs, held=["a lot"]))
    assert not readable(dict(obs, recovery={"events": [{"op": "c10d.send.default", "bytes": 8, "peer": "0"}]}))
    assert not readable(dict(obs, recovery={"events": [], "writes": [3]}))


# --- messages that did not match: gloo aborts the receiving rank ---------------------------------------------------


GLOO_ABORT = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
              "gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 48 vs 4. Received data size doesn't "
              "match expected size. Is there a distributed collective mismatch in your code?")


def journal(run_dir, rank: int, notes: list[tuple]) -> None:
    """Rank ``rank``'s notes, written as its driver writes them: (op, peer, tensor, what) each."""
    book = MessageJournal(str(run_dir), rank)
    for op, peer, tensor, what in notes:
        book.message(op, peer, ([tensor], None, peer, 0), "recover_from_peer", lambda t, what=what: what)
    book.close()


def test_a_receive_that_met_a_message_of_another_size_is_named(tmp_path):
    """The source sends its state in another order than the wiped rank receives it: the wiped rank is aborted
    mid-recovery and its record is lost; the notes each rank wrote before each message say which pair differed."""
    bias_avg, step = torch.zeros(6, dtype=torch.float64), torch.tensor(2.0)
    journal(tmp_path, 1, [("recv_", 3, torch.zeros(6, dtype=torch.float64), "'head.bias'"),
                          ("recv_", 3, torch.tensor(0.0), "the step of 'head.bias'")])
    journal(tmp_path, 3, [("send", 1, torch.zeros(6, dtype=torch.float64), "'head.bias'"),
                          ("send", 1, bias_avg, "the exp_avg of 'head.bias'"), ("send", 1, step, "the step of 'x'")])
    ranks = [RankOutcome(0, "killed"), RankOutcome(1, "exited", exitcode=-6, output=GLOO_ABORT),
             RankOutcome(2, "killed"), RankOutcome(3, "killed")]
    rank, said = mismatch.explain(WorldOutcome(4, ranks, run_dir=str(tmp_path)))
    assert rank == 1
    assert said.startswith("recover_from_peer: rank 1's 2nd receive from rank 3 (4 bytes: float32 [], the step of "
                           "'head.bias') met rank 3's 2nd send to it (48 bytes: float64 [6], the exp_avg of "
                           "'head.bias')")
    assert "Is there a distributed collective mismatch?" in said and "in the same order" in said


def test_an_abort_without_readable_notes_still_says_what_gloo_saw(tmp_path):
    (tmp_path / journal_name(1)).write_text("not json\n{\"op\": 7}\n")
    ranks = [RankOutcome(0, "ok", result={}), RankOutcome(1, "exited", exitcode=-6, output=GLOO_ABORT)]
    rank, said = mismatch.explain(WorldOutcome(2, ranks, run_dir=str(tmp_path)))
    assert rank == 1 and "a message of 48 bytes arrived for a receive of 4" in said
    assert mismatch.explain(WorldOutcome(2, [RankOutcome(0, "exited", output="Segmentation fault")])) is None
