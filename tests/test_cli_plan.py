"""`ddp-grade plan`: shut until 41 and 42 pass, then the cost model's answer (grader.capacity) in words or JSON.

Every test has a temporary state folder (DDP_GRADE_STATE_DIR), so the learner's own progress is never read.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from grader import capacity
from grader.cli import main
from grader.exits import EXIT_FAILED, EXIT_OK, EXIT_UNUSABLE
from grader.progress import Progress

MODEL_8B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "128256", "--seq-len", "8192"]
PLAN = ["--dp", "8", "--tp", "8", "--pp", "1", "--zero", "1", "--micro-batch", "1", "--micro-batches", "8",
        "--schedule", "1f1b", "--precision", "bf16-mixed", "--recompute", "selective"]


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def opened(state):
    progress = Progress()
    progress.record_grading("41", "passed")
    progress.record_grading("42", "passed")
    return state


def invoke(*args):
    return CliRunner().invoke(main, ["plan", *args])


def test_refused_without_progress_in_one_line_and_exit_1(state):
    result = invoke(*MODEL_8B, *PLAN)
    assert result.exit_code == EXIT_FAILED and result.stdout == ""
    assert result.stderr == "ddp-grade plan opens once 41 and 42 pass (41: not passed yet; 42: not passed yet)\n"


def test_refused_while_one_of_the_two_has_not_passed_and_names_it(state):
    progress = Progress()
    progress.record_grading("42", "passed")
    progress.record_grading("41", "failed")
    result = invoke("--scenario", "8B on 64 GPUs", "--json")
    assert result.exit_code == EXIT_FAILED and result.stdout == ""
    assert "(41: not passed yet; 42: passed)" in result.stderr


def test_a_pass_forgotten_by_reset_does_not_count(state):
    progress = Progress()
    for ex in ("41", "42"):
        progress.record_grading(ex, "passed")
    progress.forget("41")
    assert invoke("--scenario", "8B").exit_code == EXIT_FAILED


def test_refused_before_the_input_is_even_looked_at(state):
    result = invoke(*MODEL_8B, "--tp", "3")
    assert result.exit_code == EXIT_FAILED and "opens once 41 and 42 pass" in result.stderr


def test_help_works_while_refused(state):
    result = invoke("--help")
    assert result.exit_code == EXIT_OK and "--global-batch-tokens" in result.stdout


def test_opens_with_41_and_42_passed_and_shows_every_part(opened):
    result = invoke(*MODEL_8B, *PLAN)
    assert result.exit_code == EXIT_OK, result.output
    text = result.stdout
    for part in ("Memory per rank", "params", "grads", "optimizer", "activations", "fits in 80 GB",
                 "Traffic per step", "dp reduce-scatter", "dp all-gather", "tp all-reduce",
                 "Step time", "flops", "compute_s", "dp_s", "tp_s", "pp_s", "bubble_s", "exposed_dp_s", "total_s",
                 "tokens/s per GPU", "What limits it:", "dp 8 x tp 8 x pp 1 = 64 GPUs"):
        assert part in text, part
    model = capacity.ModelSpec(32, 4096, 32, 128256, 8192)
    plan = capacity.Plan(8, 8, 1, 1, 1, 8, "1f1b", "bf16-mixed", "selective")
    memory = capacity.training_memory(model, plan)
    assert f"{memory.total:,} B" in text and f"{memory.activations:,} B" in text  # bytes, exactly
    assert f"{memory.total / 1e9:,.3f} GB" in text
    for said in capacity.limits(model, plan, capacity.H100):
        assert f"  - {said}" in text


def test_json_is_the_cost_models_figures(opened):
    result = invoke(*MODEL_8B, *PLAN, "--json", "--inter-gbps", "25", "--memory-gb", "40")
    assert result.exit_code == EXIT_OK, result.output
    data = json.loads(result.stdout)
    model = capacity.ModelSpec(32, 4096, 32, 128256, 8192)
    plan = capacity.Plan(8, 8, 1, 1, 1, 8, "1f1b", "bf16-mixed", "selective")
    cluster = capacity.Cluster(**{**capacity.to_dict(capacity.H100), "gpus": 64, "inter_node_bandwidth": 25e9,
                                  "memory_bytes": 40e9})
    assert data["cluster"] == capacity.to_dict(cluster)
    assert data["plan"] == capacity.to_dict(plan) and data["model"] == capacity.to_dict(model)
    memory = capacity.training_memory(model, plan)
    assert data["memory"] == {**capacity.to_dict(memory), "capacity": 40e9, "fits": memory.total <= 40e9}
    traffic = capacity.communication(model, plan)
    assert data["traffic"] == {"dp": traffic.dp, "tp": traffic.tp, "pp": traffic.pp, "total": traffic.total()}
    time = capacity.step_time(model, plan, cluster)
    assert data["step_time"] == capacity.to_dict(time)
    assert data["global_batch_tokens"] == 8 * 8 * 8192
    assert data["tokens_per_s_per_gpu"] == pytest.approx(8 * 8 * 8192 / time.total_s / 64)
    assert data["limits"] == capacity.limits(model, plan, cluster)


def test_the_cluster_defaults_to_h100s_as_many_as_the_plan_uses(opened):
    data = json.loads(invoke(*MODEL_8B, "--dp", "2", "--tp", "2", "--pp", "2", "--json").stdout)
    assert data["cluster"] == {**capacity.to_dict(capacity.H100), "gpus": 8}
    assert data["plan"] == capacity.to_dict(capacity.Plan(dp=2, tp=2, pp=2))


def test_a_plan_that_does_not_fit_is_an_answer(opened):
    result = invoke(*MODEL_8B, "--precision", "fp32", "--json")
    assert result.exit_code == EXIT_OK
    data = json.loads(result.stdout)
    assert data["memory"]["fits"] is False and data["limits"][0].startswith("memory:")
    assert "does NOT fit in 80 GB" in invoke(*MODEL_8B, "--precision", "fp32").stdout


@pytest.mark.parametrize("name", ["70B on 1,024 GPUs", "70b on 1024 gpus", "70B"])
def test_a_scenario_shows_the_best_plan_of_the_search(opened, name):
    result = invoke("--scenario", name, "--json")
    assert result.exit_code == EXIT_OK, result.output
    data = json.loads(result.stdout)
    model, cluster, tokens = capacity.SCENARIOS["70B on 1,024 GPUs"]
    best = capacity.best_plan(model, cluster, tokens)
    assert data["scenario"] == "70B on 1,024 GPUs" and data["plan"] == capacity.to_dict(best)
    assert data["searched"] == len(list(capacity.candidate_plans(model, cluster, tokens)))
    assert data["limits"] == capacity.limits(model, best, cluster)
    text = invoke("--scenario", name).stdout
    assert text.startswith("Scenario: 70B on 1,024 GPUs") and "the fastest that fits:" in text


def test_a_scenario_with_a_plan_given_evaluates_that_plan(opened):
    model, cluster, _ = capacity.SCENARIOS["8B on 64 GPUs"]
    data = json.loads(invoke("--scenario", "8B", "--dp", "8", "--tp", "8", "--json").stdout)
    assert data["plan"] == capacity.to_dict(capacity.Plan(dp=8, tp=8)) and "searched" not in data
    assert data["step_time"] == capacity.to_dict(capacity.step_time(model, capacity.Plan(dp=8, tp=8), cluster))


def test_best_searches_for_the_model_and_the_gpus(opened):
    result = invoke(*MODEL_8B, "--best", "--global-batch-tokens", "4194304", "--gpus", "64", "--json")
    assert result.exit_code == EXIT_OK, result.output
    model, cluster, tokens = capacity.SCENARIOS["8B on 64 GPUs"]
    assert json.loads(result.stdout)["plan"] == capacity.to_dict(capacity.best_plan(model, cluster, tokens))


def test_best_says_when_no_plan_fits(opened):
    result = invoke(*MODEL_8B, "--best", "--global-batch-tokens", "4194304", "--gpus", "64", "--memory-gb", "1")
    assert result.exit_code == EXIT_OK
    assert "No plan: none of the" in result.stdout and "fits in 1 GB per GPU" in result.stdout
    data = json.loads(invoke(*MODEL_8B, "--best", "--global-batch-tokens", "4194304", "--gpus", "7", "--json").stdout)
    assert data["plan"] is None and data["searched"] == 0 and "over 7 GPUs" in data["why"]


@pytest.mark.parametrize("args, said", [
    ([*MODEL_8B, "--tp", "3"], "tensor-parallel size 3 does not divide 32 heads"),
    ([*MODEL_8B, "--pp", "5"], "5 pipeline stages do not divide 32 layers"),
    ([*MODEL_8B, "--dp", "8", "--tp", "8", "--gpus", "32"], "dp x tp x pp = 8 x 8 x 1 = 64, not the world size 32"),
    ([*MODEL_8B, "--dp", "2", "--pp", "2", "--zero", "3"], "ZeRO stage 3 with 2 pipeline stages is refused"),
    ([*MODEL_8B, "--schedule", "interleaved"], "plan.schedule must be one of gpipe, 1f1b"),
    ([*MODEL_8B, "--hidden", "4100"], "hidden 4100 is not divisible by heads 32"),
    (["--scenario", "7B on 8 GPUs"], "no scenario '7B on 8 GPUs'; the scenarios: \"8B on 64 GPUs\""),
    (["--scenario", "8B", "--layers", "4"], "--scenario sets the model: leave out --layers"),
    (["--layers", "32", "--hidden", "4096"], "the model needs --heads, --vocab, --seq-len (or --scenario NAME)"),
    ([*MODEL_8B, "--best", "--gpus", "64"], "--best needs --gpus and --global-batch-tokens"),
    ([*MODEL_8B, "--best", "--gpus", "64", "--global-batch-tokens", "4194304", "--tp", "2"],
     "--best searches the plan: leave out --tp"),
    (["--scenario", "70B", "--best", "--zero", "1"], "--best searches the plan: leave out --zero"),
    ([*MODEL_8B, "--best", "--gpus", "64", "--global-batch-tokens", "1000"],
     "global batch of 1000 tokens is not a whole number of 8192-token sequences"),
    ([*MODEL_8B, "--dp", "2", "--global-batch-tokens", "8192"], "= 16,384 tokens, not the global batch 8,192"),
    ([*MODEL_8B, "--mfu", "1.5"], "--mfu is the fraction of peak compute achieved, at most 1, not 1.5"),
    ([*MODEL_8B, "--memory-gb", "0"], "--memory-gb must be a number above 0, not 0"),
])
def test_input_the_cost_model_cannot_use_is_one_line_and_exit_2(opened, args, said):
    result = invoke(*args)
    assert result.exit_code == EXIT_UNUSABLE, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    assert result.stdout == "" and result.stderr.count("\n") == 1
    assert result.stderr.startswith("ddp-grade plan: error: ") and said in result.stderr, result.stderr
