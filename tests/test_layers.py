"""The layers stay apart: checks never reach up into grading, the harness never into checks."""

from __future__ import annotations

import ast

from conftest import ROOT


def imported_modules(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_check_module_imports_the_grading_layer():
    for path in sorted((ROOT / "grader" / "checks").glob("*.py")):
        assert not any(m == "grader.grading" or m.startswith("grader.grading.") for m in imported_modules(path)), path.name


def test_the_harness_knows_nothing_of_the_layers_above_it():
    text = (ROOT / "grader" / "harness.py").read_text(encoding="utf-8")
    for above in ("grader.checks", "grader.grading", "grader.report", "grader.cli"):
        assert above not in text, above


def test_exit_codes_are_defined_once():
    for path in sorted((ROOT / "grader").rglob("*.py")):
        if path.name == "options.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and name.id.startswith("EXIT_") and name.id != "EXIT_CODES":
                        raise AssertionError(f"{path.relative_to(ROOT)} defines {name.id}; import it from grader.options")
