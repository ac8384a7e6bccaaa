"""Exercise 00, the template: sum_over_ranks(t), the sum of ``t`` over every rank, ``t`` left as it was.

Start exercise NN from a copy of this package (``grader/checks/exNN_slug/``), or fold its four files into one
module ``exNN_slug.py`` with a ``# --- in each rank`` section above a ``# --- in the grader`` one. Its catalog
entry, stub and answers are in ``tests/template/``, and ``tests/test_template.py`` grades them, so the template
always runs.

Rank side (``rank.py``): each rank builds its tensor (the grader builds the same ones), calls the learner's
function in the grader's own process group and records what came back, as plain data; it decides nothing.
Grader side: the expected sum (``reference.py``), then one verdict per check of the catalog (``verdicts.py``),
from the ranks' records.
"""

from __future__ import annotations

from grader.checks.ex00_template.rank import rank_main
from grader.checks.ex00_template.reference import expected_sum
from grader.checks.ex00_template.verdicts import check_input_kept, check_sum
from grader.checks.interface import Grader


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        records = g.run(rank_main, world_size).results()  # one record per rank, in rank order
        check_sum(g, records, expected_sum(world_size), world_size)
        check_input_kept(g, records, world_size)
