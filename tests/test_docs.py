"""The README stays in step with the catalog and the CLI."""

from __future__ import annotations

from click.testing import CliRunner

from conftest import ROOT
from grader import catalog, docs
from grader.cli import main


def test_the_generated_docs_match_the_catalog():
    """The README's exercise tables and docs/checks.md are what `python -m grader.docs --write` writes."""
    readme = (ROOT / "README.md").read_text()
    assert docs.replace_section(readme) == readme, "run: python -m grader.docs --write"
    assert (ROOT / "docs" / "checks.md").read_text() == docs.checks_page(), "run: python -m grader.docs --write"


def test_a_drifted_generated_doc_is_seen():
    readme = (ROOT / "README.md").read_text()
    stale = readme.replace("| 01 | `exercises/01_setup.py`", "| 01 | `exercises/01_old.py`", 1)
    assert stale != readme and docs.replace_section(stale) == readme


def test_every_exercise_is_in_the_readme_and_every_check_in_the_checks_page():
    readme, checks = (ROOT / "README.md").read_text(), (ROOT / "docs" / "checks.md").read_text()
    for ex in catalog.exercises():
        assert f"exercises/{ex.filename}" in readme
        for check in ex.checks:
            assert f"`{check.id}`" in checks


def test_the_readme_is_a_first_ten_minutes_and_reaches_every_page_of_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in sorted((ROOT / "docs").glob("*.md")):
        linked = [p for p in (ROOT / "docs").glob("*.md") if f"({page.name}" in p.read_text()]
        assert f"(docs/{page.name})" in readme or linked, f"docs/{page.name} cannot be reached from the README"


def _runs(text: str, size: int = 3) -> set[tuple[str, ...]]:
    """Every run of ``size`` consecutive non-blank lines of prose (tables and code left out)."""
    keep, fenced = [], False
    for line in (ln.strip() for ln in text.splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        elif line and not fenced and not line.startswith(("|", "#", "<!--")):
            keep.append(line.lstrip("-* "))
    return {tuple(keep[i:i + size]) for i in range(len(keep) - size + 1)}


def test_no_page_keeps_a_hand_copy_of_another():
    """Each text is written once: no three lines of prose in a row are repeated across README, CONTRIBUTING
    and docs/ (the generated tables are left out)."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    seen: dict = {}
    for page in pages:
        for run in _runs(page.read_text()):
            other = seen.setdefault(run, page.name)
            assert other == page.name, f"{page.name} repeats {other}: {run[0][:60]}..."


def test_every_command_has_help_text():
    runner = CliRunner()
    for name, command in main.commands.items():
        assert command.help, f"{name} has no help text"
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)


def test_the_readme_documents_every_exit_code_of_grading():
    readme = (ROOT / "README.md").read_text()
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |"):
        assert code in readme
