"""The README stays in step with the catalog and the CLI."""

from __future__ import annotations

from click.testing import CliRunner

from conftest import ROOT
from grader import catalog, docs
from grader.cli import main


def test_readme_check_tables_match_the_catalog():
    readme = (ROOT / "README.md").read_text()
    assert docs.replace_section(readme) == readme, "run: python -m grader.docs --write"


def test_every_exercise_is_listed_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    for ex in catalog.exercises():
        assert f"exercises/{ex.filename}" in readme
        for check in ex.checks:
            assert f"`{check.id}`" in readme


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
