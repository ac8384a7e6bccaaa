"""CONTRIBUTING.md's list of the files an exercise takes is true and complete."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import inspect
import re
import shutil
from pathlib import Path

import pytest

from conftest import ROOT, kit_files
from grader import catalog

TABLE = re.compile(r"<!-- files-per-exercise:start -->(.*?)<!-- files-per-exercise:end -->", re.S)


def listed_files() -> list[tuple[str, bool]]:
    """(pattern, required) from the table in CONTRIBUTING.md."""
    text = TABLE.search((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")).group(1)
    return [(m.group(1), m.group(2) == "yes") for m in re.finditer(r"^\| `([^`]+)` \| (yes|no) \|", text, re.M)]


def for_exercise(pattern: str, ex: catalog.Exercise) -> str:
    track = f"{ex.track}/" if ex.is_debug else ""
    return pattern.replace("[debug/]", track).replace("NN", ex.id).replace("slug", ex.slug)


def test_the_list_names_the_files_every_exercise_needs():
    files = listed_files()
    assert files and any(required for _, required in files)
    tracked = kit_files()
    for ex in catalog.exercises():
        for pattern, required in files:
            if required:
                wanted = for_exercise(pattern, ex)
                assert fnmatch.filter(tracked, wanted), f"exercise {ex.id}: no {wanted} (CONTRIBUTING.md lists it)"


def _named_for(ex: catalog.Exercise, path: str) -> bool:
    """Whether ``path`` carries exercise ``ex``'s name: its module or file name, or NN_ in a folder of tests."""
    return any(n in path for n in (f"{ex.id}_{ex.slug}", f"ex{ex.id}_{ex.slug}")) or \
        bool(re.match(rf"tests/\w+/{ex.id}_", path))


@pytest.mark.parametrize("ex", catalog.exercises(), ids=lambda ex: ex.id)
def test_every_file_named_for_an_exercise_is_in_the_list(ex):
    """Each exercise in turn, as if it were the newest: every file its name is in (its checks in either shape,
    stubs, solutions, variants, right and hostile answers, tests) is one the list admits."""
    allowed = [for_exercise(pattern, ex) for pattern, _ in listed_files()]
    outside = [path for path in kit_files() if _named_for(ex, path)
               and not any(fnmatch.fnmatch(path, a) for a in allowed)]
    assert outside == [], f"exercise {ex.id}: {outside} are not among an exercise's files in CONTRIBUTING.md"


def naming_the_newest_outside_the_list(root: Path = ROOT) -> list[str]:
    """The kit's files (below ``root``) that name the newest exercise or its module and are not among the files
    CONTRIBUTING.md lists for an exercise."""
    newest = catalog.exercises()[-1]
    allowed = [for_exercise(pattern, newest) for pattern, _ in listed_files()]
    names = (f"{newest.id}_{newest.slug}", f"ex{newest.id}_{newest.slug}")
    outside = []
    for path in kit_files(root):
        by_name = any(n in path for n in names) or re.match(rf"tests/\w+/{newest.id}_", path)
        try:
            by_text = any(n in (root / path).read_text(encoding="utf-8", errors="replace") for n in names)
        except OSError:
            by_text = False
        if (by_name or by_text) and not any(fnmatch.fnmatch(path, a) for a in allowed):
            outside.append(path)
    return outside


def test_nothing_outside_the_list_names_the_newest_exercise():
    """Adding the newest exercise touched only the listed files: no other file names it or its module."""
    assert naming_the_newest_outside_the_list() == [], "these name the newest exercise, but CONTRIBUTING.md " \
        "does not list them among an exercise's files"


def test_in_a_copy_of_the_kit_without_git_the_list_is_the_kits_files_without_caches_or_builds(tmp_path):
    """A downloaded archive has no .git: the files are then a walk of the folder that leaves out what .gitignore
    names (Hypothesis's cache, bytecode, the environment, build outputs), where Hypothesis and pip write files
    that name the newest exercise; a note of the learner's that names it is still found."""
    copy = tmp_path / "kit"
    for path in kit_files():
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, copy / path)
    newest = catalog.exercises()[-1]
    naming = f"grader.checks.ex{newest.id}_{newest.slug}\n"
    made = [".hypothesis/examples/0a1b/2c3d", "grader/__pycache__/catalog.cpython-311.pyc", ".pytest_cache/v/x",
            "ddp_grade.egg-info/SOURCES.txt", ".venv/lib/python3.11/site-packages/x.pth", "build/lib/x.py",
            "dist/x.txt", "exercises/__pycache__/x.pyc"]
    for path in made:
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        (copy / path).write_text(naming)
    assert not (copy / ".git").exists()
    files = kit_files(copy)
    assert sorted(files) == sorted(kit_files()), set(files) ^ set(kit_files())
    assert naming_the_newest_outside_the_list(copy) == []
    (copy / "notes.txt").write_text(naming)  # the kit's own file, as far as a copy can tell: still looked at
    assert naming_the_newest_outside_the_list(copy) == ["notes.txt"]


def test_the_gitignore_is_a_list_of_names():
    """kit_files reads .gitignore as names of files and folders anywhere below the kit (it refuses any other
    form): caches and build outputs, each named."""
    from conftest import not_the_kits

    names = not_the_kits()
    assert {".hypothesis", "__pycache__", ".pytest_cache", "*.egg-info", ".venv", "build", "dist"} <= set(names)


# --- an exercise: its drivers on the rank side, its checks (one module, or a package of roles) -----------

CHECKS = ROOT / "grader" / "checks"
DRIVERS = ROOT / "grader" / "rank" / "drivers"
ROLES = {"__init__.py", "reference.py", "verdicts.py"}
RANK_MARKERS, GRADER_MARKER = ("# --- in each rank", "# --- in the worker"), "# --- in the grader"


def _drivers(tree) -> list[str]:
    """The functions of a module that a rank runs: their first parameter is the rank's ``ctx``."""
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.args.args
            and node.args.args[0].arg == "ctx"]


def _imports(tree) -> set[str]:
    """The modules ``tree`` imports; ``from package import role`` counts as ``package.role``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            roles = [a.name for a in node.names if f"{a.name}.py" in ROLES]
            found |= {f"{node.module}.{r}" for r in roles} if roles else {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def _defines(tree, name: str) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


TEMPLATE = catalog.read((ROOT / "tests" / "template" / "catalog.toml").read_text(encoding="utf-8"))[0]


@pytest.mark.parametrize("ex", [TEMPLATE, *catalog.exercises()], ids=lambda ex: ex.id)
def test_every_exercise_is_its_drivers_and_checks_in_one_of_the_two_shapes(ex):
    """What the ranks run in grader/rank/drivers/exNN_slug.py (the rank side, the one package a sandbox holds);
    what decides in a module grader/checks/exNN_slug.py, or a package grader/checks/exNN_slug/ whose files are
    named by their role. No driver on the grader's side, no section of the other side in either."""
    name = f"ex{ex.id}_{ex.slug}"
    drivers = DRIVERS / f"{name}.py"
    assert drivers.exists(), f"exercise {ex.id} has no drivers module grader/rank/drivers/{name}.py"
    rank_text = drivers.read_text(encoding="utf-8")
    rank_tree = ast.parse(rank_text)
    assert ast.get_docstring(rank_tree) and not _defines(rank_tree, "grade"), f"{drivers.name}: no grade here"
    assert not any(line.startswith(GRADER_MARKER) for line in rank_text.splitlines()), f"{drivers.name}: one side"
    assert sorted(p.name for p in CHECKS.glob(f"ex{ex.id}_*")) == [p.name for p in (CHECKS / f"{name}.py",
                                                                                     CHECKS / name) if p.exists()]
    module, package = CHECKS / f"{name}.py", CHECKS / name
    if module.exists():
        text = module.read_text(encoding="utf-8")
        tree = ast.parse(text)
        assert _defines(tree, "grade") and ast.get_docstring(tree)
        assert not _drivers(tree), f"{module.name} defines a driver: drivers live in grader/rank/drivers/{name}.py"
        assert not any(line.startswith(RANK_MARKERS) for line in text.splitlines()), f"{module.name}: one side only"
        return
    files = {p.name for p in package.glob("*.py")}
    assert files <= ROLES and "__init__.py" in files, sorted(files - ROLES)
    trees = {f: ast.parse((package / f).read_text(encoding="utf-8")) for f in files}
    assert ast.get_docstring(trees["__init__.py"]) and _defines(trees["__init__.py"], "grade")
    for f, tree in trees.items():
        assert not _drivers(tree), f"{name}/{f} defines a driver: drivers live in grader/rank/drivers/{name}.py"
    above = {"reference.py": ("verdicts",), "verdicts.py": ()}
    for f, roles in above.items():
        if f in trees:
            imported = _imports(trees[f])
            wrong = [m for m in imported if m == f"grader.checks.{name}" or
                     any(m == f"grader.checks.{name}.{r}" for r in roles)]
            assert wrong == [], f"{name}/{f} imports {wrong}"
    loaded = importlib.import_module(f"grader.checks.{name}")
    for f in files - {"__init__.py"}:  # a name __init__ imports must not hide a role's module
        assert inspect.ismodule(getattr(loaded, f[:-3])), f"{name}.{f[:-3]} is not the module {f}"
