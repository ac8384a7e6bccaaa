"""What each check stands on: every check of the catalog says (value, kernel or claim), and where claims count
for nothing (--sandbox, batch, Gradescope) a grading passes only on evidence."""

from __future__ import annotations

import pytest

from grader import catalog


def test_every_check_says_what_it_stands_on_and_it_is_one_of_the_three():
    checks = [(ex.id, c.id, c.evidence) for ex in catalog.exercises() for c in ex.checks]
    assert checks and all(evidence in catalog.EVIDENCE for _, _, evidence in checks)
    assert set(catalog.EVIDENCE) == {"value", "kernel", "claim"}
    assert {evidence for _, _, evidence in checks} == set(catalog.EVIDENCE)


ENTRY = '''
[[exercise]]
id = "00"
slug = "x"
title = "x"
functions = ["f"]

  [[exercise.check]]
  id = "a"
  title = "a"
'''


@pytest.mark.parametrize("line, problem", [("", "None"), ('  evidence = "probe"', "'probe'")])
def test_a_check_without_its_evidence_or_with_another_word_is_refused(line, problem):
    with pytest.raises(ValueError, match=f"check a: evidence {problem}"):
        catalog.read(ENTRY + line + "\n")


def test_the_catalog_reads_what_a_check_stands_on():
    (exercise,) = catalog.read(ENTRY + '  evidence = "kernel"\n')
    assert exercise.checks[0].evidence == catalog.KERNEL
