"""`ddp-grade plan`: shut until 41 and 42 pass, then the cost model's answer (grader.capacity) in words or JSON.

Every test has a temporary state folder (DDP_GRADE_STATE_DIR), so the learner's own progress is never read.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import shlex

from grader import capacity
from grader import capacity_plans as plans
from grader import capacity_published as published
from grader import capacity_speed as speed
from grader.commands import plan as plan_module
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


def jsonish(value) -> dict:
    """A dataclass of capacity as `--json` prints it (tuples as lists)."""
    return json.loads(json.dumps(capacity.to_dict(value)))


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


def test_the_published_table_answers_before_41_and_42_pass(state):
    """The papers' figures beside the kit's are no answer a learner is writing: shown at once, in words and
    as JSON, while a plan of one's own stays refused."""
    text = invoke("--published")
    assert text.exit_code == EXIT_OK and "Llama 3" in text.stdout, text.output
    rows = json.loads(invoke("--published", "--json").stdout)
    assert len(rows) == len(published.ROWS)
    assert invoke(*MODEL_8B, *PLAN).exit_code == EXIT_FAILED
    assert invoke("--scenario", "8B").exit_code == EXIT_FAILED


def test_compute_efficiency_is_the_input_efficiency_and_mfu_its_old_name(opened):
    """--compute-efficiency sets the fraction of peak the compute runs at; --mfu still means it; the answer's
    mfu is what the step achieves (lower: communication and the bubble add to the step)."""
    new = json.loads(invoke(*MODEL_8B, *PLAN, "--compute-efficiency", "0.4", "--json").stdout)
    old = json.loads(invoke(*MODEL_8B, *PLAN, "--mfu", "0.4", "--json").stdout)
    assert new == old and new["cluster"]["mfu"] == 0.4
    assert new["mfu"] < 0.4


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
    for said in plans.limits(model, plan, plans.on(plans.H100, 64), plans.timer_for(plans.H100)):
        assert f"  - {said}" in text
    assert "The kit's step time (docs/capacity.md): compute_s holds" in text and "straggler_s" in text


def test_json_is_the_cost_models_figures(opened):
    result = invoke(*MODEL_8B, *PLAN, "--json", "--inter-gbps", "25", "--memory-gb", "40")
    assert result.exit_code == EXIT_OK, result.output
    data = json.loads(result.stdout)
    model = capacity.ModelSpec(32, 4096, 32, 128256, 8192)
    plan = capacity.Plan(8, 8, 1, 1, 1, 8, "1f1b", "bf16-mixed", "selective")
    cluster = capacity.Cluster(**{**capacity.to_dict(plans.H100), "gpus": 64, "inter_node_bandwidth": 25e9,
                                  "memory_bytes": 40e9})
    assert data["cluster"] == jsonish(cluster)
    assert data["plan"] == jsonish(plan) and data["model"] == jsonish(model)
    memory = capacity.training_memory(model, plan)
    assert data["memory"] == {**capacity.to_dict(memory), "capacity": 40e9, "fits": memory.total <= 40e9,
                              "model_states": memory.params + memory.grads + memory.optimizer}
    traffic = capacity.communication(model, plan)
    assert data["traffic"] == {**capacity.to_dict(traffic), "total": traffic.total()}
    parts = speed.breakdown(model, plan, cluster, "H100")
    time = parts.step
    assert data["step_time"] == capacity.to_dict(time)
    assert data["compute"] == {"model": "kit", "matmul_s": parts.matmul_s, "attention_s": parts.attention_s,
                               "memory_s": parts.memory_s, "hidden_tp_s": parts.hidden_tp_s,
                               "straggler_s": parts.straggler_s}
    assert data["global_batch_tokens"] == 8 * 8 * 8192
    assert data["tokens_per_s_per_gpu"] == pytest.approx(8 * 8 * 8192 / time.total_s / 64)
    assert data["limits"] == plans.limits(model, plan, cluster, plans.kit_timer("H100"))
    rates = plans.utilisation(model, plan, cluster, time)
    assert (data["mfu"], data["tflops_per_gpu"]) == (rates["mfu"], rates["tflops_per_gpu"]) and data["gpu"] == "H100"


def test_compute_efficiency_times_the_plan_as_42_does(opened):
    """With --compute-efficiency the answer is 42's step time at that efficiency, which the learner's own
    step_time gives; without it, the kit's, which reads no efficiency."""
    data = json.loads(invoke(*MODEL_8B, *PLAN, "--compute-efficiency", "0.54", "--json").stdout)
    model = capacity.ModelSpec(32, 4096, 32, 128256, 8192)
    plan = capacity.Plan(8, 8, 1, 1, 1, 8, "1f1b", "bf16-mixed", "selective")
    cluster = plans.on(plans.H100, 64)
    assert data["step_time"] == capacity.to_dict(capacity.step_time(model, plan, cluster))
    assert data["compute"] == {"model": "42", "efficiency": 0.54}
    assert "42's step time: every FLOP at 0.54 of the peak" in invoke(*MODEL_8B, *PLAN, "--mfu", "0.54").stdout
    kit = json.loads(invoke(*MODEL_8B, *PLAN, "--json").stdout)
    assert kit["step_time"] == capacity.to_dict(speed.step_time(model, plan, cluster, "H100"))
    assert kit["step_time"] != data["step_time"]


def test_a_float8_plan_answers_on_h100_and_is_refused_on_a100(opened):
    """fp8-mixed: the layers' linear maps at the float8 peak, the rest bf16, the casts paid; an A100 has no
    float8 tensor cores, and 42's one efficiency does not time it."""
    fp8 = json.loads(invoke(*MODEL_8B, *PLAN, "--precision", "fp8-mixed", "--json").stdout)
    bf16 = json.loads(invoke(*MODEL_8B, *PLAN, "--json").stdout)
    assert fp8["plan"]["precision"] == "fp8-mixed" and fp8["memory"] == bf16["memory"]
    assert fp8["compute"]["matmul_s"] < bf16["compute"]["matmul_s"] and fp8["compute"]["memory_s"] > bf16["compute"]["memory_s"]
    assert fp8["tokens_per_s_per_gpu"] > bf16["tokens_per_s_per_gpu"]
    refused = invoke(*MODEL_8B, *PLAN, "--precision", "fp8-mixed", "--gpu", "A100")
    assert refused.exit_code == EXIT_UNUSABLE and "fp8-mixed needs float8 tensor cores: the A100 has none" in refused.stderr
    flat = invoke(*MODEL_8B, *PLAN, "--precision", "fp8-mixed", "--compute-efficiency", "0.5")
    assert flat.exit_code == EXIT_UNUSABLE and "fp8-mixed is timed by the kit's model" in flat.stderr


def test_the_cluster_defaults_to_h100s_as_many_as_the_plan_uses(opened):
    data = json.loads(invoke(*MODEL_8B, "--dp", "2", "--tp", "2", "--pp", "2", "--json").stdout)
    assert data["cluster"] == {**capacity.to_dict(plans.H100), "gpus": 8}
    a100 = json.loads(invoke(*MODEL_8B, "--dp", "2", "--gpu", "A100", "--json").stdout)
    assert a100["cluster"] == {**capacity.to_dict(plans.A100), "gpus": 2} and a100["gpu"] == "A100"
    assert data["plan"] == jsonish(capacity.Plan(dp=2, tp=2, pp=2))


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
    model, cluster, tokens = plans.SCENARIOS["70B on 1,024 GPUs"]
    best = plans.best_plan(model, cluster, tokens)
    assert data["scenario"] == "70B on 1,024 GPUs" and data["plan"] == jsonish(best)
    assert data["searched"] == len(list(plans.candidate_plans(model, cluster, tokens))) and data["search"] == "43"
    assert data["limits"] == plans.limits(model, best, cluster)  # 43's rules, 43's (that is 42's) step time
    assert data["compute"]["model"] == "42"
    text = invoke("--scenario", name).stdout
    assert text.startswith("Scenario: 70B on 1,024 GPUs") and "the fastest that fits:" in text
    assert "(43's rules leave out what frontier runs add; --search kit searches with it)" in text


def test_a_scenario_with_a_plan_given_evaluates_that_plan(opened):
    model, cluster, _ = plans.SCENARIOS["8B on 64 GPUs"]
    data = json.loads(invoke("--scenario", "8B", "--dp", "8", "--tp", "8", "--json").stdout)
    assert data["plan"] == jsonish(capacity.Plan(dp=8, tp=8)) and "searched" not in data
    assert data["step_time"] == capacity.to_dict(speed.step_time(model, capacity.Plan(dp=8, tp=8), cluster, "H100"))


def test_best_searches_for_the_model_and_the_gpus(opened):
    result = invoke(*MODEL_8B, "--best", "--global-batch-tokens", "4194304", "--gpus", "64", "--json")
    assert result.exit_code == EXIT_OK, result.output
    model, cluster, tokens = plans.SCENARIOS["8B on 64 GPUs"]
    data = json.loads(result.stdout)
    assert data["search"] == "kit" and data["plan"] == jsonish(plans.best_frontier(model, cluster, tokens))
    rules = json.loads(invoke(*MODEL_8B, "--best", "--global-batch-tokens", "4194304", "--gpus", "64", "--search", "43",
                              "--json").stdout)
    assert rules["search"] == "43" and rules["plan"] == jsonish(plans.best_plan(model, cluster, tokens))


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
    ([*MODEL_8B, "--tp", "2", "--sp"], "sequence parallelism keeps no whole tensor on a rank"),
    ([*MODEL_8B, "--pp", "2", "--stage-layers", "8,x"], "--stage-layers takes counts like 8,8 or 0,1x126,0"),
    ([*MODEL_8B, "--pp", "2", "--stage-layers", "16x3"], "stage_layers needs 2 counts (pp x vpp)"),
    ([*MODEL_8B, "--cp", "2"], "context parallelism needs attention='flash'"),
    (["--published", "--dp", "2"], "--published shows the published rows: leave out --dp"),
    ([*MODEL_8B, "--schedule", "interleaved"], "plan.schedule must be one of gpipe, 1f1b"),
    ([*MODEL_8B, "--pp", "2", "--vpp", "2", "--micro-batches", "3"], "interleaving needs micro_batches (3) to be a"),
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
    ([*MODEL_8B, "--mfu", "1.5"], "--compute-efficiency is the fraction of peak every FLOP runs at, at most 1, not 1.5"),
    ([*MODEL_8B, "--compute-efficiency", "0"], "--compute-efficiency must be a number above 0, not 0"),
    ([*MODEL_8B, "--memory-gb", "0"], "--memory-gb must be a number above 0, not 0"),
])
def test_input_the_cost_model_cannot_use_is_one_line_and_exit_2(opened, args, said):
    result = invoke(*args)
    assert result.exit_code == EXIT_UNUSABLE, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    assert result.stdout == "" and result.stderr.count("\n") == 1
    assert result.stderr.startswith("ddp-grade plan: error: ") and said in result.stderr, result.stderr


def run_command(command: str) -> dict:
    """`ddp-grade plan ... --json` run as the command line says."""
    words = shlex.split(command)
    assert words[:2] == ["ddp-grade", "plan"] and words[-1] == "--json"
    result = invoke(*words[2:])
    assert result.exit_code == EXIT_OK, (command, result.output)
    return json.loads(result.stdout)


def test_published_json_rows_name_their_group_and_source_and_each_command_reproduces_its_figure(opened):
    result = invoke("--published", "--json")
    assert result.exit_code == EXIT_OK, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == len(published.ROWS) == 8 + 28 + 36
    assert [row["group"] for row in rows] == ["fit"] * 8 + ["formula"] * 28 + ["held-out"] * 36
    assert {row["source"] for row in rows} == set(published.SOURCES)
    for row in rows:
        assert {"group", "source", "metric", "published", "kit", "command"} <= set(row)
        assert row["ratio"] == pytest.approx(row["kit"] / row["published"])
        assert plan_module.at_path(run_command(row["command"]), row["metric"]) == row["kit"], row["command"]
        assert ("--gpu" in row["command"]) == (row["group"] != "formula") == (row["gpu"] is not None)


def test_published_text_shows_the_three_groups_apart_with_the_constants_and_the_held_out_error(opened):
    result = invoke("--published")
    assert result.exit_code == EXIT_OK, result.output
    text = result.stdout
    rows = plan_module.published_rows()
    summary = plan_module.summary(rows)
    fitted, held = text.index("FITTED ON:"), text.index("HELD OUT:")
    assert fitted < text.index("FORMULAS:") < held
    assert f"K0 = {speed.K0:g}" in text and f"link efficiency {speed.LINK_EFFICIENCY:g}" in text
    assert f"held-out rows {summary['held_out']['rms']:.1%}" in text and f"{len(published.HELD_OUT_ROWS)} rows" in text
    for row in rows:
        at = text.index(f"{row['ratio']:>8.3f}", text.index(row["row"]))
        assert (at < text.index("FORMULAS:")) == (row["group"] == "fit") and (at > held) == (row["group"] == "held-out")
    assert "Llama 3 (arXiv 2407.21783v3), Table 4 (MFU, H100; rms" in text and "43.0%" in text
    assert "v1 and v2 print DP 4" in text and "formula, no GPU" in text and "no GPU: it ran V100s" in text


def test_best_on_a_published_scenario_says_what_limits_the_pick_and_the_published_plan(opened):
    result = invoke("--scenario", "Llama 3 405B, 128K context, on 16,384 GPUs", "--best", "--json")
    assert result.exit_code == EXIT_OK, result.output
    data = json.loads(result.stdout)
    row = published.LLAMA_ROWS[2]
    assert data["search"] == "kit" and data["published_plan"]["plan"] == jsonish(row.plan)
    model, cluster, tokens = plans.FRONTIER["Llama 3 405B, 128K context, on 16,384 GPUs"]
    assert data["plan"] == jsonish(plans.best_frontier(model, cluster, tokens, row.plan))
    kit = plans.kit_timer("H100")
    assert data["published_plan"]["limits"] == plans.limits(model, row.plan, cluster, kit)
    assert data["published_plan"]["why"] == plans.why_differ(model, cluster, plans.best_frontier(model, cluster, tokens,
                                                                                                   row.plan), row.plan,
                                                             timer=kit)
    text = invoke("--scenario", "Llama 3 405B, 128K context, on 16,384 GPUs").stdout
    assert f"The published plan ({published.LLAMA}):" in text and "Why they differ: " in text
    assert text.count("What limits it:") == 2


def test_the_frontier_model_options_reach_the_model(opened):
    data = json.loads(invoke("--layers", "4", "--hidden", "64", "--heads", "8", "--vocab", "256", "--seq-len", "128",
                             "--kv-heads", "2", "--ffn", "160", "--mlp", "swiglu", "--norm", "rmsnorm", "--no-bias",
                             "--positions", "rope", "--no-dropout", "--tp", "2", "--sp", "--vocab-parallel",
                             "--attention", "flash", "--pp", "2", "--vpp", "2", "--stage-layers", "0,2x2,0",
                             "--micro-batches", "4", "--no-dp-overlap", "--no-tp-overlap", "--grad-fp32",
                             "--json").stdout)
    model = capacity.ModelSpec(4, 64, 8, 256, 128, kv_heads=2, ffn=160, mlp="swiglu", norm="rmsnorm", bias=False,
                               positions="rope", dropout=False)
    plan = capacity.Plan(tp=2, pp=2, micro_batches=4, sp=True, vpp=2, stage_layers=(0, 2, 2, 0), vocab_parallel=True,
                         attention="flash", dp_overlap=False, tp_overlap=False, grad_fp32=True)
    assert data["model"] == jsonish(model) and data["plan"] == jsonish(plan)
    assert data["memory"]["total"] == capacity.training_memory(model, plan).total
