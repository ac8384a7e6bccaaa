"""The layers stay apart: checks never reach up into grading, the harness never into checks."""

from __future__ import annotations

import ast
import re

from conftest import ROOT


def imported_modules(path, modules: set[str] | None = None) -> set[str]:
    """The names ``path`` imports: each module, and ``module.name`` for each name taken from one. Given the
    package's ``modules``, ``from package import submodule`` counts as the submodule alone."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # under TYPE_CHECKING too
        if isinstance(node, ast.ImportFrom) and node.module:
            taken = {f"{node.module}.{a.name}" for a in node.names}
            names.update(taken)
            if modules is None or not taken <= modules:
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_check_module_imports_the_grading_layer():
    for path in sorted((ROOT / "grader" / "checks").glob("*.py")):
        assert not any(m == "grader.grading" or m.startswith("grader.grading.") for m in imported_modules(path)), path.name


def test_the_harness_knows_nothing_of_the_layers_above_it():
    text = (ROOT / "grader" / "rank" / "harness.py").read_text(encoding="utf-8")
    for above in ("grader.checks", "grader.grading", "grader.report", "grader.cli"):
        assert above not in text, above


def test_every_click_decorator_is_in_the_command_line_package():
    """One home for the command line: every click command, group, option and argument is declared in
    grader/cli/, one module a command."""
    declared = ("command", "group", "option", "argument", "version_option", "pass_context")
    found = []
    for path in sorted((ROOT / "grader").rglob("*.py")):
        if {"cli", "stubs"} & set(path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in declared and isinstance(node.value, ast.Name) \
                    and node.value.id == "click":
                found.append(f"{path.relative_to(ROOT)} line {node.lineno}: click.{node.attr}")
    assert found == []


def test_drivers_take_their_context_from_the_rank_side():
    """One place: a driver names RankContext as grader.rank.child defines it; nothing on the grader's side
    names it (no driver lives there)."""
    found = []
    for path in sorted((ROOT / "grader").rglob("*.py")):
        rank_side = (ROOT / "grader" / "rank") in path.parents
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and any(alias.name == "RankContext" for alias in node.names) \
                    and (node.module != "grader.rank.child" or not rank_side):
                found.append(f"{path.relative_to(ROOT)} line {node.lineno}: from {node.module}")
    assert found == []


def test_exit_codes_are_defined_once():
    for path in sorted((ROOT / "grader").rglob("*.py")):
        if path.name == "exits.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name) and name.id.startswith("EXIT_") and name.id != "EXIT_CODES":
                        raise AssertionError(f"{path.relative_to(ROOT)} defines {name.id}; import it from grader.exits")


# --- the import graph of the whole package ---------------------------------------------------------------
#
# Layers, lowest first. A module may import its own layer and the layers below it, never one above,
# imports inside functions included; and no two modules import each other, however indirectly.
LAYERS = [
    ("base", ["grader", "grader.rank", "grader.exits", "grader.rank.limits", "grader.state", "grader.catalog", "grader.compare",
              "grader.rank.wire", "grader.rank.sock_diag", "grader.kit", "grader.learner", "grader.rank.untrusted", "grader.rank.checkpoints", "grader.quiz.question", "grader.quiz.giveaways", "grader.quiz.bank", "grader.capacity",
              "grader.capacity_layout", "grader.capacity_speed", "grader.capacity_plans", "grader.capacity_published", "grader.resilience"]),
    ("data", ["grader.results", "grader.progress", "grader.quiz.session", "grader.timeline"]),
    ("harness", ["grader.rank.probes", "grader.rank.order", "grader.rank.memory", "grader.rank.child", "grader.rank.processes", "grader.rank.outcomes", "grader.rank.harness",
                 "grader.diagnose", "grader.rank.rank_timeline", "grader.rank.rank_host", "grader.rank.pool", "grader.rank.pool_ctrl_c", "grader.traffic",
                 "grader.sandbox", "grader.sandbox.*"]),
    ("grading", ["grader.rank.drivers", "grader.rank.drivers.*", "grader.checks", "grader.checks.*", "grader.grading", "grader.options"]),
    ("render", ["grader.report", "grader.batch_output", "grader.live", "grader.quiz.render", "grader.docs",
                "grader.timeline_view"]),
    ("flows", ["grader.server", "grader.batch", "grader.shards", "grader.protocol", "grader.worker", "grader.flow", "grader.gradescope", "grader.commands", "grader.commands.*",
               "grader.quiz", "grader.quiz.terminal", "grader.stubs", "grader.stubs.*"]),
    ("cli", ["grader.cli", "grader.cli.*", "grader.__main__"]),
]


def _modules() -> dict[str, object]:
    found = {}
    for path in (ROOT / "grader").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _layer_of(name: str) -> int:
    for k, (_, members) in enumerate(LAYERS):
        for member in members:
            if name == member or (member.endswith(".*") and name.startswith(member[:-1])):
                return k
    raise AssertionError(f"{name} is in no layer of tests/test_layers.py: say where it belongs")


def import_graph() -> dict[str, set[str]]:
    """{module: the grader modules it imports anywhere in its file}."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        imported = imported_modules(path, set(modules))
        graph[name] = {m for m in imported if m in modules and m != name}
        graph[name] |= {m.rsplit(".", 1)[0] for m in imported
                        if m.rsplit(".", 1)[0] in modules and m.rsplit(".", 1)[0] != name and m not in modules}
    return graph


def test_every_module_has_a_layer_and_no_import_runs_back_up():
    graph = import_graph()
    upward = [f"{a} ({LAYERS[_layer_of(a)][0]}) imports {b} ({LAYERS[_layer_of(b)][0]})"
              for a, targets in sorted(graph.items()) for b in sorted(targets)
              if _layer_of(b) > _layer_of(a) and not (a == "grader" or b == "grader")]
    assert upward == [], "\n".join(upward)


def test_no_two_modules_import_each_other_however_indirectly():
    graph = import_graph()
    cycles, index, low, stack, on_stack, counter = [], {}, {}, [], set(), [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_graph_test_sees_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The two tests above can fail: a made-up package where the data layer imports the renderer."""
    (tmp_path / "grader").mkdir()
    (tmp_path / "grader" / "results.py").write_text("from grader.report import problem_text\n")
    (tmp_path / "grader" / "report.py").write_text("import grader.results\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    graph = import_graph()
    assert graph["grader.results"] == {"grader.report"} and graph["grader.report"] == {"grader.results"}
    try:
        test_every_module_has_a_layer_and_no_import_runs_back_up()
    except AssertionError as exc:
        assert "grader.results (data) imports grader.report (render)" in str(exc)
    else:
        raise AssertionError("the upward import was not seen")
    try:
        test_no_two_modules_import_each_other_however_indirectly()
    except AssertionError:
        pass
    else:
        raise AssertionError("the circle was not seen")


def test_an_import_for_annotations_only_counts_too(tmp_path, monkeypatch):
    """Two modules that import each other, one of them only under ``if TYPE_CHECKING:``: still a circle."""
    (tmp_path / "grader" / "quiz").mkdir(parents=True)
    (tmp_path / "grader" / "quiz" / "bank.py").write_text("from grader.quiz.giveaways import score\n")
    (tmp_path / "grader" / "quiz" / "giveaways.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grader.quiz.bank import Question\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert import_graph()["grader.quiz.giveaways"] == {"grader.quiz.bank"}
    try:
        test_no_two_modules_import_each_other_however_indirectly()
    except AssertionError:
        pass
    else:
        raise AssertionError("the circle through an annotation was not seen")


def test_the_grading_object_has_every_member_the_checks_interface_names():
    """Check modules annotate ``grade(g: Grader)``; the grading layer's Grading is what they get."""
    import inspect

    from grader.checks.interface import Grader
    from grader.grading import Grading

    names = [n for n in vars(Grader) if not n.startswith("_")] + list(Grader.__annotations__)
    set_in_init = inspect.getsource(Grading.__init__)
    for name in names:
        assert hasattr(Grading, name) or f"self.{name} =" in set_in_init, f"Grading has no {name}"
        wanted = vars(Grader).get(name)
        if inspect.isfunction(wanted) or isinstance(wanted, staticmethod):
            theirs = inspect.signature(getattr(Grader, name))
            ours = inspect.signature(getattr(Grading, name))
            assert list(theirs.parameters) == list(ours.parameters), (name, theirs, ours)


def undefined_names(*paths) -> list[str]:
    """pyflakes' 'undefined name' findings in ``paths`` (files or folders), one line each."""
    import io

    from pyflakes import api, reporter

    out = io.StringIO()
    api.checkRecursive([str(p) for p in paths], reporter.Reporter(out, out))
    return [line for line in out.getvalue().splitlines() if "undefined name" in line]


def test_no_code_of_the_kit_uses_a_name_that_nothing_defines(tmp_path):
    """A name nothing defines is a NameError only when its line runs: after the drivers moved, 35's checks still
    called ``rank.linear_main`` and only the full suite's gradings of 35 found it. Read, not run, in a second."""
    assert undefined_names(*(ROOT / d for d in ("grader", "tests", "solutions", "benchmarks"))) == []
    moved = tmp_path / "checks.py"
    moved.write_text("def grade(g):\n    return rank.linear_main\n")
    assert len(undefined_names(moved)) == 1 and "'rank'" in undefined_names(moved)[0]


def test_no_module_of_the_grader_is_longer_than_600_lines():
    """A module a newcomer can read: past 600 lines, the rank side or the verdicts go to a module of
    their own (CONTRIBUTING.md, "The checks module")."""
    long = {str(path.relative_to(ROOT)): n for path in (ROOT / "grader").rglob("*.py")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > 600}
    assert long == {}


# --- CONTRIBUTING.md's module map, made from LAYERS and each module's first sentence ----------------------
#
# python tests/test_layers.py --write puts it in; the test below says when it is out of date.

LAYER_WORDS = {
    "base": "plain data and pure functions any module may use",
    "data": "what a grading, the learner's progress and a quiz session hold, as data",
    "harness": "processes: the warm pool, the ranks and what they did, the probes inside them, the sandbox",
    "grading": "deciding: a grading and every exercise's checks",
    "render": "words: reports, the live line, timelines, the generated docs",
    "flows": "what a command does, without click",
    "cli": "the command line",
}
MAP = re.compile(r"(<!-- module-map:start -->\n)(.*?)(<!-- module-map:end -->)", re.S)
EXERCISE_CHECKS = re.compile(r"^grader\.checks\.ex\d\d_")
EXERCISE_DRIVERS = re.compile(r"^grader\.rank\.drivers\.ex\d\d_")


def first_sentence(path) -> str:
    """A module's docstring up to the end of its first sentence, as Markdown."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    end = re.search(r"(?<!\.)[.!?](\s|$)", text)
    text = text[:end.start() + 1] if end else text
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`").replace("|", "\\|")


def module_map() -> str:
    modules = _modules()
    lines = []
    for layer, _ in LAYERS:
        lines += [f"**{layer}**: {LAYER_WORDS[layer]}", "", "| module | what it is |", "|---|---|"]
        names = sorted((n for n in modules if _layer_of(n) == LAYERS.index((layer, _)) and n != "grader"),
                       key=lambda n: str(modules[n]))
        summarized = set()
        for name in names:
            path = modules[name].relative_to(ROOT)
            if EXERCISE_CHECKS.match(name):
                if "exercises" not in summarized:
                    summarized.add("exercises")
                    lines.append("| `grader/checks/exNN_slug.py`, `grader/checks/exNN_slug/` | an exercise's checks, one per "
                                 "exercise of the catalog (\"The checks module\" below; `ex00_template` is the "
                                 "template) |")
                continue
            if EXERCISE_DRIVERS.match(name):
                if "drivers" not in summarized:
                    summarized.add("drivers")
                    lines.append("| `grader/rank/drivers/exNN_slug.py` | an exercise's drivers, one per exercise of the "
                                 "catalog: what its ranks run (\"The checks module\" below) |")
                continue
            if name == "grader.stubs" or name.startswith("grader.stubs."):
                if "stubs" not in summarized:
                    summarized.add("stubs")
                    lines.append("| `grader/stubs/` | the stubs as shipped, copied by `python -m grader.docs --write` "
                                 "(what `reset` puts back) |")
                continue
            lines.append(f"| `{path}` | {first_sentence(modules[name])} |")
        lines.append("")
    return "\n".join(lines)


def test_every_module_says_what_it_is_in_its_first_sentence():
    silent = [str(p.relative_to(ROOT)) for n, p in _modules().items()
              if not (n.startswith("grader.stubs") or EXERCISE_CHECKS.match(n) or EXERCISE_DRIVERS.match(n))
              and not first_sentence(p)]
    assert silent == []


def test_contributing_module_map_is_current():
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    found = MAP.search(text)
    assert found, "CONTRIBUTING.md has no module map"
    assert found.group(2) == module_map(), "run: python tests/test_layers.py --write"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python tests/test_layers.py --write  (CONTRIBUTING.md's module map, from LAYERS)")
    path = ROOT / "CONTRIBUTING.md"
    path.write_text(MAP.sub(lambda m: m.group(1) + module_map() + m.group(3), path.read_text(encoding="utf-8")),
                    encoding="utf-8")
