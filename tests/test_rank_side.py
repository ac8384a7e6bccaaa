"""No answer inside the sandbox: the rank side (grader/rank/) imports nothing else of the kit, holds no module
or function that computes an exercise's answer, and is all of the kit a sandbox shows (docs/guarantees.md)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT
from grader import catalog, sandbox
from test_layers import imported_modules

RANK = ROOT / "grader" / "rank"
# What decides on the grader's side: the cost and resilience models (41-44's answers), every exercise's
# references and verdicts, the comparison and the grading. None of it may be importable in a rank.
ANSWER_MODULES = ("grader.capacity", "grader.capacity_layout", "grader.capacity_plans", "grader.capacity_published",
                  "grader.resilience", "grader.checks", "grader.checks.ex07_ring_allreduce",
                  "grader.checks.ex35_float8.reference", "grader.checks.ex37_weight_sync.reference",
                  "grader.compare", "grader.grading", "grader.catalog")
# Functions of the grader's that compute an answer (41-44's models, 07's sum, 35's casts and products, 37's
# slices): defined nowhere on the rank side. Nor is a function named as one the learner writes, in the
# exercise's own drivers or in what the drivers share (a solution there would be found by its name).
ANSWER_NAMES = {"expected_sum", "training_memory", "communication", "step_time", "choose_plan", "goodput",
                "best_checkpoint_interval", "expected_call", "gather_expected", "training_reference", "to_float8",
                "scale_of", "split_dim", "inference_range", "kept_ranges", "expected"}
LEARNERS = {f"ex{ex.id}_{ex.slug}": set(ex.functions) for ex in catalog.exercises()}


def rank_modules() -> dict[str, Path]:
    found = {}
    for path in sorted(RANK.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def test_the_rank_side_imports_nothing_else_of_the_kit():
    """Every import of every module of grader/rank/, inside functions too, is of grader/rank/ (or the bare
    package, whose __init__ imports nothing)."""
    outside = {}
    for name, path in rank_modules().items():
        wrong = sorted(m for m in imported_modules(path) if (m == "grader" or m.startswith("grader."))
                       and not (m in ("grader", "grader.rank") or m.startswith("grader.rank.")))
        if wrong:
            outside[name] = wrong
    assert outside == {}


def test_the_package_itself_imports_nothing():
    tree = ast.parse((ROOT / "grader" / "__init__.py").read_text(encoding="utf-8"))
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_no_rank_module_defines_an_answer():
    """No function or class named as a learner's function or as one of the grader's answers, at the top of
    any module of the rank side: a solution imported from there would be found by name."""
    found = []
    everyone = set().union(*LEARNERS.values()) - {"main"}
    for name, path in rank_modules().items():
        leaf = name.rsplit(".", 1)[-1]
        answers = ANSWER_NAMES | (LEARNERS.get(leaf, set()) if leaf in LEARNERS else
                                  everyone if ".shared." in name else set())
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in answers:
                found.append(f"{name}.{node.name}")
            targets = node.targets if isinstance(node, ast.Assign) else []
            found += [f"{name}.{t.id}" for t in targets if isinstance(t, ast.Name) and t.id in answers]
    assert found == []


PROBE = r"""
import importlib, json, pkgutil, sys
import grader.rank
loaded, failed = [], []
for info in pkgutil.walk_packages(grader.rank.__path__, "grader.rank."):
    try:
        importlib.import_module(info.name)
        loaded.append(info.name)
    except Exception as exc:
        failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
reachable = []
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
        reachable.append(name)
    except ImportError:
        pass
answers = sorted(f"{module.__name__}.{attr}" for module in list(sys.modules.values())
                 if getattr(module, "__name__", "").startswith("grader") for attr in json.loads(sys.argv[2])
                 if callable(getattr(module, attr, None)))
print(json.dumps({"loaded": loaded, "failed": failed, "reachable": reachable, "answers": answers,
                  "grader": sorted(n for n in sys.modules if n == "grader" or n.startswith("grader."))}))
"""


def test_only_the_rank_side_on_the_path_imports_every_module_and_reaches_no_answer(tmp_path):
    """A fresh interpreter that sees grader/__init__.py and grader/rank/ alone (a copy, with the installed
    packages but not the kit: no site hook, so no editable install finds the rest) imports every module of the
    rank side, finds no module of the grader's side, and no answer among the names of what it loaded."""
    (tmp_path / "grader").mkdir()
    shutil.copy(ROOT / "grader" / "__init__.py", tmp_path / "grader" / "__init__.py")
    shutil.copytree(RANK, tmp_path / "grader" / "rank", ignore=shutil.ignore_patterns("__pycache__"))
    paths = [str(tmp_path), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    code = "import sys; sys.path[:0] = " + repr(paths) + "\n" + PROBE
    done = subprocess.run([sys.executable, "-S", "-c", code, json.dumps(ANSWER_MODULES), json.dumps(sorted(ANSWER_NAMES))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["failed"] == []
    assert set(seen["loaded"]) >= {f"grader.rank.drivers.ex{ex.id}_{ex.slug}" for ex in catalog.exercises()}
    assert "grader.rank.rank_host" in seen["loaded"]
    assert seen["reachable"] == [] and seen["answers"] == []
    assert [n for n in seen["grader"] if n != "grader" and not n.startswith("grader.rank")] == []


def test_the_probe_finds_what_it_looks_for(tmp_path):
    """The test above can fail: with the whole package on the path, the models are reachable and their
    answers found by name."""
    code = "import sys; sys.path[:0] = " + repr([str(ROOT)]) + "\nimport grader.resilience, grader.capacity\n" + PROBE
    done = subprocess.run([sys.executable, "-c", code, json.dumps(ANSWER_MODULES[:2]), json.dumps(["goodput",
                                                                                                  "training_memory"])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["reachable"] == ["grader.capacity", "grader.capacity_layout"]
    assert seen["answers"] == ["grader.capacity.training_memory", "grader.resilience.goodput"]


# --- what a sandbox shows of the kit -------------------------------------------------------------------------

TOOLS = [pytest.param(t, marks=pytest.mark.skipif(not (shutil.which(t) and sandbox._works(t)),
                                                  reason=f"{t} cannot build a sandbox here"))
         for t in (sandbox.BWRAP, sandbox.UNSHARE)]

VIEW = r"""
import importlib, json, os, sys
import grader
folder = os.path.dirname(grader.__file__)
out = {"package": sorted(os.listdir(folder)), "rank": sorted(os.listdir(os.path.join(folder, "rank"))),
       "folder": folder}
out["reachable"] = []
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
        out["reachable"].append(name)
    except ImportError:
        pass
try:
    open(os.path.join(folder, "capacity.py"), "w").close()
    out["written"] = True
except OSError:
    out["written"] = False
print(json.dumps(out))
"""


def _view(tool: str, env: dict | None = None, python_path: str = "") -> dict:
    """What a process in a sandbox built by ``tool`` sees of the grader's package (run from a fresh
    interpreter, so that ``python_path`` decides where the package is)."""
    code = ("import json, subprocess, sys\nfrom grader import sandbox\nfd = sandbox.filter_descriptor()\n"
            f"argv = sandbox.wrap([sys.executable, '-c', {VIEW!r}, {json.dumps(json.dumps(ANSWER_MODULES))}], [], "
            f"{tool!r}, filter_fd=fd)\n"
            "done = subprocess.run(argv, capture_output=True, text=True, timeout=120, pass_fds=(fd,), "
            "env=sandbox.environment({}, 2**24))\n"
            "print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else 'failed: ' + done.stderr[-2000:])\n")
    run_env = {**os.environ, **(env or {})}
    if python_path:
        run_env["PYTHONPATH"] = python_path
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=run_env,
                          cwd=tempfile.gettempdir())
    assert done.returncode == 0 and not done.stdout.startswith("failed"), done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("tool", TOOLS)
def test_a_sandbox_shows_the_rank_side_alone(tool):
    """Of the grader's package, a sandbox holds __init__.py and rank/ alone, read-only: the grader's side
    cannot be imported there, and nothing can be written beside them."""
    seen = _view(tool)
    assert seen["package"] == ["__init__.py", "rank"], seen
    assert "drivers" in seen["rank"] and "rank_host.py" in seen["rank"]
    assert seen["reachable"] == [] and seen["written"] is False


@pytest.mark.slow
@pytest.mark.parametrize("tool", TOOLS)
def test_a_kit_in_a_folder_bound_whole_shows_the_rank_side_alone(tool, tmp_path_factory):
    """An installed kit lies in site-packages, which a sandbox binds whole (the Gradescope bundle's does):
    there too the package holds only its rank side inside."""
    site = Path(tempfile.mkdtemp(prefix="ddp-grade-site-", dir="/var/tmp"))
    try:
        shutil.copytree(ROOT / "grader", site / "grader", ignore=shutil.ignore_patterns("__pycache__"))
        seen = _view(tool, python_path=str(site))
    finally:
        shutil.rmtree(site, ignore_errors=True)
    assert seen["folder"] == str(site / "grader")
    assert seen["package"] == ["__init__.py", "rank"], seen
    assert seen["reachable"] == [] and seen["written"] is False
