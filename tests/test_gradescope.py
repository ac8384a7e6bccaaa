"""`ddp-grade gradescope build`: the bundle, its setup.sh (run offline with stand-in installers), and its
run_autograder run on a passing, a failing, a crashing, a hanging and a missing submission in a folder
laid out like /autograder, each results.json checked against Gradescope's documented format."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import ROOT
from grader import catalog, gradescope, sandbox
from grader.options import GradeOptions
from grader.cli import main

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# Gradescope's results.json, from its "Autograder Specifications" page: each key, the types it may
# hold, and for some the values allowed. Keys not listed there are errors here.
VISIBILITIES = {"hidden", "after_due_date", "after_published", "visible"}
FORMATS = {"text", "simple_format", "html", "md", "ansi"}
RESULTS_SCHEMA = {
    "score": ((int, float), None),
    "execution_time": ((int, float), None),
    "output": ((str,), None),
    "output_format": ((str,), FORMATS),
    "test_output_format": ((str,), FORMATS),
    "test_name_format": ((str,), FORMATS),
    "visibility": ((str,), VISIBILITIES),
    "stdout_visibility": ((str,), VISIBILITIES),
    "extra_data": ((dict,), None),
    "tests": ((list,), None),
    "leaderboard": ((list,), None),
}
TEST_SCHEMA = {
    "score": ((int, float), None),
    "max_score": ((int, float), None),
    "status": ((str,), {"passed", "failed"}),
    "name": ((str,), None),
    "name_format": ((str,), FORMATS),
    "number": ((str,), None),
    "output": ((str,), None),
    "output_format": ((str,), FORMATS),
    "tags": ((list,), None),
    "visibility": ((str,), VISIBILITIES),
    "extra_data": ((dict,), None),
}
# What this bundle promises on top of the format: every test says all of these.
TEST_REQUIRED = {"name", "score", "max_score", "status", "output", "visibility"}


def schema_errors(data) -> list[str]:
    """Where ``data`` leaves Gradescope's results format ([] when it does not)."""
    errors = []

    def check(obj, schema, where):
        if not isinstance(obj, dict):
            return [f"{where} is not an object"]
        out = []
        for key, value in obj.items():
            if key not in schema:
                out.append(f"{where}.{key} is not a field of the format")
                continue
            types, allowed = schema[key]
            if isinstance(value, bool) or not isinstance(value, types):
                out.append(f"{where}.{key} is {type(value).__name__}, not {'/'.join(t.__name__ for t in types)}")
            elif allowed is not None and value not in allowed:
                out.append(f"{where}.{key} is {value!r}, not one of {sorted(allowed)}")
        return out

    errors += check(data, RESULTS_SCHEMA, "results")
    if "score" not in data and not all("score" in t for t in data.get("tests", [])):
        errors.append("no score: neither at the top nor on every test")
    for i, test in enumerate(data.get("tests", [])):
        errors += check(test, TEST_SCHEMA, f"tests[{i}]")
        errors += [f"tests[{i}] has no {key}" for key in sorted(TEST_REQUIRED - set(test))]
        if isinstance(test.get("tags"), list) and not all(isinstance(t, str) for t in test["tags"]):
            errors.append(f"tests[{i}].tags holds something other than strings")
    return errors


def test_the_schema_check_itself_catches_what_it_should():
    good = {"score": 1.0, "tests": [{"name": "a", "score": 1, "max_score": 1, "status": "passed", "output": "",
                                     "visibility": "visible"}]}
    assert schema_errors(good) == []
    bad = {"score": "1", "tests": [{"name": "a", "score": 1, "max_score": 1, "status": "ok", "output": "",
                                    "visibility": "public", "colour": "red"}]}
    errors = schema_errors(bad)
    assert any("results.score is str" in e for e in errors)
    assert any("status is 'ok'" in e for e in errors) and any("visibility is 'public'" in e for e in errors)
    assert any("colour is not a field" in e for e in errors)
    assert schema_errors({"tests": [{"name": "a", "status": "passed"}]})  # no score anywhere, missing fields


def _bundle(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "autograder.zip"
    result = CliRunner().invoke(main, ["gradescope", "build", "-o", str(out), *args])
    assert result.exit_code == 0, result.output
    return out


def test_the_bundle_holds_the_scripts_at_its_root_the_kit_and_no_answers(tmp_path):
    out = _bundle(tmp_path, "--exercises", "01,3", "--timeout", "20", "--visibility", "after_due_date")
    with zipfile.ZipFile(out) as bundle:
        names = bundle.namelist()
        modes = {i.filename: i.external_attr >> 16 for i in bundle.infolist()}
        config = json.loads(bundle.read("ddp-grade.json"))
        setup = bundle.read("setup.sh").decode()
    assert {"setup.sh", "run_autograder", "ddp-grade.json", "kit/pyproject.toml", "kit/grader/catalog.toml",
            "kit/grader/cli/__init__.py", "kit/grader/checks/ex03_train.py"} <= set(names)
    assert modes["setup.sh"] & stat.S_IXUSR and modes["run_autograder"] & stat.S_IXUSR
    assert not any(n.startswith(("solutions/", "tests/", "exercises/")) or "__pycache__" in n for n in names)
    assert config == {"exercises": ["01", "03"], "options": GradeOptions(timeout_s=20.0).to_dict(), "sandbox": "auto",
                      "visibility": "after_due_date"}
    assert f'"torch=={gradescope.TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu' in setup
    assert gradescope.TORCH_VERSION == "2.13.0"
    again = _bundle(tmp_path / "again", "--exercises", "01,3", "--timeout", "20", "--visibility", "after_due_date")
    assert again.read_bytes() == out.read_bytes()  # the same kit and options, the same bundle


def test_the_kit_in_the_bundle_needs_what_the_project_needs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(d for d in project["dependencies"] if not d.startswith("torch")) == \
        sorted(gradescope.KIT_DEPENDENCIES)
    packed = tomllib.loads(gradescope.pyproject())
    assert packed["project"]["scripts"] == project["scripts"]


def test_setup_sh_installs_python_cpu_torch_and_the_kit(tmp_path):
    """setup.sh run to its end with stand-ins for apt-get and python3 that record what they are asked."""
    root = tmp_path / "autograder"
    (root / "source").mkdir(parents=True)
    with zipfile.ZipFile(_bundle(tmp_path)) as bundle:
        bundle.extractall(root / "source")
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    recorder = f'echo "$(basename "$0") $*" >> {log}\n'
    (bin_dir / "apt-get").write_text("#!/bin/sh\n" + recorder)
    (bin_dir / "python3").write_text("#!/bin/sh\n" + recorder + (
        'if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then\n'
        '  mkdir -p "$3/bin"\n'
        f"  for tool in pip ddp-grade; do printf '#!/bin/sh\\n{recorder}' > \"$3/bin/$tool\"; "
        'chmod +x "$3/bin/$tool"; done\n'
        "fi\n"))
    for tool in ("apt-get", "python3"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "AUTOGRADER_ROOT": str(root), "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(root / "source" / "setup.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "apt-get update"
    assert calls[1].startswith("apt-get install -y") and "python3-venv" in calls[1] and "bubblewrap" in calls[1]
    assert calls[3] == f"python3 -m venv {root}/venv"
    assert calls[4] == (f"pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    assert calls[5] == f"pip install --no-cache-dir {root}/source/kit"
    assert calls[6] == "ddp-grade doctor --no-group"


def test_bad_options_and_a_broken_bundle_get_one_line_and_exit_2(tmp_path):
    result = CliRunner().invoke(main, ["gradescope", "build", "--exercises", "01,77", "-o", str(tmp_path / "a.zip")])
    assert result.exit_code == 2 and "unknown exercise '77'" in result.output
    assert not (tmp_path / "a.zip").exists()
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "ddp-grade.json").write_text("{not json")
    result = CliRunner().invoke(main, ["gradescope", "run", "--root", str(tmp_path)])
    assert result.exit_code == 2 and "cannot be used" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "results" / "results.json").exists()  # an autograder failure, not a grade


def test_files_are_found_by_their_exercise_name_anywhere_in_the_submission(tmp_path):
    ex01, ex03 = catalog.by_id("01"), catalog.by_id("03")
    (tmp_path / "repo" / "exercises").mkdir(parents=True)
    (tmp_path / "repo" / "exercises" / "01_setup.py").write_text("")
    (tmp_path / "01_mine.py").write_text("")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "03_train.py").write_text("")
    found, notes = gradescope.find_files(tmp_path, [ex01, ex03])
    assert found == {"01": tmp_path / "repo" / "exercises" / "01_setup.py"}  # the kit's name wins
    assert "also found 01_mine.py" in notes["01"] and "no 03_train.py in the submission" in notes["03"]
    (tmp_path / "repo" / "exercises" / "01_setup.py").unlink()
    (tmp_path / "01_mine.py").rename(tmp_path / "answer.py")
    found, notes = gradescope.find_files(tmp_path, [ex01])  # one exercise, one Python file: that one
    assert found == {"01": tmp_path / "answer.py"} and "the submission's only Python file" in notes["01"]


def test_a_debugging_exercise_is_found_by_its_kit_name_under_exercises_debug(tmp_path):
    ex21, ex22 = catalog.by_id("21"), catalog.by_id("22")
    (tmp_path / "exercises" / "debug").mkdir(parents=True)
    (tmp_path / "exercises" / "debug" / "21_eval_hang.py").write_text("")
    (tmp_path / "21_first_try.py").write_text("")
    found, notes = gradescope.find_files(tmp_path, [ex21, ex22])
    assert found == {"21": tmp_path / "exercises" / "debug" / "21_eval_hang.py"}  # the kit's name wins
    assert "also found 21_first_try.py" in notes["21"] and "no 22_unused_params.py in the submission" in notes["22"]


SUBMISSIONS = {
    "passing": ROOT / "solutions" / "01_setup.py",
    "failing": ROOT / "tests" / "variants" / "01_no_timeout.py",
    "crashing": ROOT / "tests" / "hostile" / "01_segfault.py",
    "hanging": ROOT / "tests" / "hostile" / "01_endless_loop.py",
    "forging": ROOT / "tests" / "hostile" / "01_forges_verdict.py",  # an all-pass report into every pipe it reaches
    "missing": None,
}


def _run_autograder(tmp_path: Path, bundle: Path, kind: str, source: Path | None) -> dict:
    """run_autograder of ``bundle`` on ``source`` as 01_setup.py, laid out as Gradescope lays out /autograder:
    its results.json, checked against Gradescope's schema."""
    root = tmp_path / kind
    (root / "submission").mkdir(parents=True)
    with zipfile.ZipFile(bundle) as z:
        z.extractall(root / "source")
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "run_autograder").chmod(0o755)
    if source is not None:
        shutil.copy(source, root / "submission" / "01_setup.py")
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "DDP_GRADE_PYTHON": sys.executable,
           "PYTHONPATH": str(root / "source" / "kit"),  # the kit as packed, not this checkout
           "DDP_GRADE_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run([str(root / "run_autograder")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (kind, done.stdout[-2000:], done.stderr[-2000:])
    results = json.loads((root / "results" / "results.json").read_text())
    assert schema_errors(results) == [], (kind, schema_errors(results))
    return results


@pytest.mark.slow
def test_a_rank_that_speaks_as_the_sandboxs_host_scores_nothing(tmp_path):
    """tests/sandboxed/01_speaks_as_the_host.py writes the host's answer through every way it finds: in the
    bundle's sandbox it finds none, and scores 0 on its own failure."""
    bundle = _bundle(tmp_path, "--exercises", "01", "--timeout", "10")
    results = _run_autograder(tmp_path, bundle, "speaking", ROOT / "tests" / "sandboxed" / "01_speaks_as_the_host.py")
    assert results["score"] == 0 and "FORGED_BY_A_RANK" not in json.dumps(results)
    assert "reached nothing" in json.dumps(results)


@pytest.mark.slow
def test_run_autograder_grades_passing_failing_crashing_hanging_and_missing_submissions(tmp_path):
    bundle = _bundle(tmp_path, "--exercises", "01", "--timeout", "10")
    checks = catalog.by_id("01").checks
    # A claim is worth nothing on Gradescope: 01 scores only what stands on evidence (collective-works, on the
    # bytes the kernel counted between the ranks), the same scale for every submission.
    total = sum(c.points for c in checks if c.evidence in catalog.ON_EVIDENCE)
    assert 0 < total < sum(c.points for c in checks)
    got = {}
    for kind, source in SUBMISSIONS.items():
        results = _run_autograder(tmp_path, bundle, kind, source)
        assert len(results["tests"]) == len(checks)
        assert 0 <= results["score"] <= sum(t["score"] for t in results["tests"])  # less what failed claims cost
        assert sum(t["max_score"] for t in results["tests"]) == total  # the same scale for every submission
        got[kind] = results
    assert got["passing"]["score"] == total and all(t["status"] == "passed" for t in got["passing"]["tests"])
    passing = {t["name"].split(":")[0]: t for t in got["passing"]["tests"]}
    assert passing["01 timeout-set"]["max_score"] == 0 and passing["01 timeout-set"]["output"].startswith("claimed:")
    claimed = sum(c.evidence == catalog.CLAIM and c.id != "nccl-device" for c in checks)  # nccl-device: skipped
    assert f"1 decided on evidence, {claimed} claimed (not scored)" in got["passing"]["output"]
    failing = {t["name"].split(":")[0]: t for t in got["failing"]["tests"]}
    assert failing["01 timeout-set"]["status"] == "failed" and failing["01 timeout-set"]["score"] == 0
    assert "hint:" in failing["01 timeout-set"]["output"]
    # a claim: worth nothing when it passes, believed when it fails (a submission's records never fail it on purpose)
    assert "costs 1 point(s) of exercise 01's" in failing["01 timeout-set"]["output"]
    assert got["failing"]["score"] == max(0.0, total - 1.0) < total
    assert got["crashing"]["score"] < total and "SIGSEGV" in got["crashing"]["output"]
    assert got["hanging"]["score"] < total and "timed out" in got["hanging"]["output"]
    assert got["missing"]["score"] == 0 and "no 01_setup.py in the submission" in got["missing"]["output"]
    forging = {t["name"].split(":")[0]: t for t in got["forging"]["tests"]}
    assert forging["01 timeout-set"]["status"] == "failed"  # its own verdict, not the all-pass report it wrote


@pytest.mark.slow
@pytest.mark.skipif(sandbox.tool() is None, reason="no sandbox tool works here")
def test_in_the_bundle_a_submission_that_imports_the_graders_answers_scores_nothing(tmp_path):
    """The kit is in the bundle whole (its runner decides), but the sandbox each submission runs in holds only
    its rank side: 07 importing the expected sum and 44 importing the resilience model score 0."""
    ring, model = sorted(ROOT.glob("tests/sandboxed/07_imports_*.py"))[0], sorted(ROOT.glob("tests/sandboxed/4?_imports_*.py"))[-1]
    bundle = _bundle(tmp_path, "--exercises", f"07,{model.name[:2]}", "--timeout", "300", "--sandbox", "on")
    root = tmp_path / "autograder"
    (root / "submission").mkdir(parents=True)
    with zipfile.ZipFile(bundle) as z:
        z.extractall(root / "source")
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    (root / "run_autograder").chmod(0o755)
    for path in (ring, model):
        shutil.copy(path, root / "submission" / catalog.by_id(path.name[:2]).filename)
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "DDP_GRADE_PYTHON": sys.executable,
           "PYTHONPATH": str(root / "source" / "kit"), "DDP_GRADE_STATE_DIR": str(tmp_path / "state")}
    done = subprocess.run([str(root / "run_autograder")], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    results = json.loads((root / "results" / "results.json").read_text())
    assert schema_errors(results) == []
    assert results["score"] == 0, [(t["name"], t["score"]) for t in results["tests"] if t["score"]]
    assert "ModuleNotFoundError" in json.dumps(results) or "ImportError" in json.dumps(results)


def test_results_score_each_check_with_its_points_and_say_what_was_observed():
    ex = catalog.by_id("01")
    checks = [{"id": c.id, "status": "pass", "message": "", "evidence": "value"} for c in ex.checks]
    checks[1] = {"id": ex.checks[1].id, "status": "fail", "message": "rank 1 joined with gloo", "rank": 1,
                 "world_size": 2, "hint": "pass backend through", "evidence": "value"}
    checks[-1] = {"id": ex.checks[-1].id, "status": "skip", "message": "runs with --backend nccl on GPUs only",
                  "evidence": "value"}
    graded = gradescope.results([ex], {"01": {"checks": checks, "problem": None}}, {}, "after_published", 12.4)
    assert schema_errors(graded) == []
    total = sum(c.points for c in ex.checks)
    assert graded["score"] == total - ex.checks[1].points and graded["execution_time"] == 12
    failed = graded["tests"][1]
    assert failed["status"] == "failed" and failed["score"] == 0 and failed["visibility"] == "after_published"
    assert failed["output"] == "rank 1 joined with gloo\n(rank 1, world size 2)\nhint: pass backend through"
    skipped = graded["tests"][-1]  # does not apply on a CPU machine: a right answer still scores the total
    assert skipped["status"] == "passed" and skipped["score"] == skipped["max_score"]
    checks[0] = {"id": ex.checks[0].id, "status": "claimed", "message": "", "evidence": "claim"}
    checks[1] = {**checks[1], "evidence": "claim"}  # a failure that stands on a claim: shown, worth nothing
    graded = gradescope.results([ex], {"01": {"checks": checks, "problem": None}}, {}, "visible", 1.0)
    claimed, failed = graded["tests"][:2]
    assert claimed["score"] == claimed["max_score"] == 0 and claimed["output"].startswith("claimed:")
    assert failed["status"] == "failed" and failed["max_score"] == 0 and "hint: pass backend through" in failed["output"]
    assert f"costs {ex.checks[1].points:g} point(s) of exercise 01's" in failed["output"]
    # a claim earns nothing and its failure costs its points: this answer is not worth the full scale
    scale = sum(t["max_score"] for t in graded["tests"])
    assert scale == total - ex.checks[0].points - ex.checks[1].points
    assert graded["score"] == scale - ex.checks[1].points
    assert f"{graded['score']:g} of {scale:g} points ({ex.checks[1].points:g} lost to checks that failed" in graded["output"]
    unusable = gradescope.results([ex], {"01": {"checks": [], "problem": "01_setup.py line 3: invalid syntax\n..."}},
                                  {}, "visible", 1.0)
    assert unusable["score"] == 0 and all(t["status"] == "failed" for t in unusable["tests"])
    assert unusable["tests"][0]["output"].startswith("not graded: 01_setup.py line 3: invalid syntax")
    assert "invalid syntax\n..." in unusable["output"]
