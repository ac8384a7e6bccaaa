"""docs/github-actions.yml: the commands it runs exist, and run in a learner's repository they grade the
exercises changed since the first commit and write the JUnit report, the JSON and the step summary."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from click.testing import CliRunner

from conftest import ROOT
from grader.cli import main

WORKFLOW = ROOT / "docs" / "github-actions.yml"


def steps() -> dict[str, str]:
    """{step name: its `run:` script} of the workflow (the subset of YAML it is written in)."""
    lines = WORKFLOW.read_text().splitlines()
    out, name, i = {}, None, 0
    while i < len(lines):
        named = re.match(r"^\s*- name: (.+)$", lines[i])
        if named:
            name = named.group(1).strip()
        block = re.match(r"^(\s*)run: \|$", lines[i])
        if block:
            indent, body = len(block.group(1)), []
            i += 1
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                body.append(lines[i])
                i += 1
            out[name] = textwrap.dedent("\n".join(body)).strip() + "\n"
            continue
        i += 1
    return out


def test_the_workflow_installs_cpu_torch_and_uses_only_options_that_exist():
    found = steps()
    assert set(found) >= {"Install CPU torch and the kit", "Find the exercises the learner changed", "Grade them"}
    assert '"torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu' in found["Install CPU torch and the kit"]
    grade = found["Grade them"]
    help_text = CliRunner().invoke(main, ["batch", "--help"]).output
    for option in set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", grade.split("ddp-grade batch", 1)[1])):
        assert option in help_text, f"the workflow passes {option}, which `ddp-grade batch` does not have"
    assert "ddp-grade-report/junit.xml" in grade and "path: ddp-grade-report/" in WORKFLOW.read_text()


def _repo(tmp_path: Path) -> tuple[Path, dict]:
    """A learner's repository as GitHub Classroom makes it: the kit's stubs as the first commit."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "exercises", repo / "exercises")
    (repo / "README.md").write_text("my DDP exercises\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "learner", "GIT_AUTHOR_EMAIL": "l@example.invalid",
           "GIT_COMMITTER_NAME": "learner", "GIT_COMMITTER_EMAIL": "l@example.invalid",
           "GITHUB_OUTPUT": str(tmp_path / "output"), "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"),
           "DDP_GRADE_STATE_DIR": str(tmp_path / "state")}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "Initial commit"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)
    return repo, env


def _commit(repo: Path, env: dict, message: str) -> None:
    for args in (["add", "-A"], ["commit", "-qm", message]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True)


def _step(name: str, repo: Path, env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run one step's script as GitHub runs it (bash -e), with `ddp-grade` the kit under test."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "ddp-grade"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m grader "$@"\n')
    shim.chmod(0o755)
    script = tmp_path / "step.sh"
    script.write_text(steps()[name])
    return subprocess.run(["bash", "-e", str(script)], cwd=repo, env={**env, "PATH": f"{bin_dir}:{env['PATH']}"},
                          capture_output=True, text=True, timeout=600)


def test_with_nothing_changed_nothing_is_graded(tmp_path):
    repo, env = _repo(tmp_path)
    (repo / "README.md").write_text("notes\n")  # not an exercise
    _commit(repo, env, "notes")
    done = _step("Find the exercises the learner changed", repo, env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "output").read_text() == "count=0\n"


@pytest.mark.slow
def test_the_changed_exercises_are_graded_with_a_junit_report_and_a_step_summary(tmp_path):
    repo, env = _repo(tmp_path)
    shutil.copy(ROOT / "solutions" / "01_setup.py", repo / "exercises" / "01_setup.py")  # done
    stub = repo / "exercises" / "02_shard.py"
    stub.write_text(stub.read_text() + "\n# started\n")  # touched, not done
    (repo / "exercises" / "04_launch.py").unlink()  # a deleted file is not graded
    _commit(repo, env, "exercise 01")
    found = _step("Find the exercises the learner changed", repo, env, tmp_path)
    assert found.returncode == 0, found.stderr
    assert (repo / "changed.txt").read_text().split() == ["exercises/01_setup.py", "exercises/02_shard.py"]
    assert (tmp_path / "output").read_text() == "count=2\n"
    graded = _step("Grade them", repo, env, tmp_path)
    assert graded.returncode != 0  # 02 does not pass: the run is marked failed
    suites = ET.parse(repo / "ddp-grade-report" / "junit.xml").getroot()
    by_name = {s.get("name"): s for s in suites.iter("testsuite")}
    assert set(by_name) == {"exercises/01_setup.py", "exercises/02_shard.py"}
    assert by_name["exercises/01_setup.py"].get("failures") == "0"
    assert by_name["exercises/01_setup.py"].find("properties/property[@name='status']").get("value") == "passed"
    results = json.loads((repo / "ddp-grade-report" / "results.json").read_text())
    assert {r["submission"]: r["status"] for r in results["reports"]} == {
        "exercises/01_setup.py": "passed", "exercises/02_shard.py": "failed"}
    # batch --no-sandbox, the learner's own repository: a claim counts as in a plain grading (none is claimed)
    assert all(r["evidence"]["claims_count"] and not r["evidence"]["claimed"] for r in results["reports"])
    summary = (tmp_path / "summary.md").read_text()
    assert "| exercises/01_setup.py | 01 | passed |" in summary
    assert "| exercises/02_shard.py | 02 | failed |" in summary and "not implemented yet" in summary
