"""Exercise 00, the template: sum_over_ranks(t), the sum of ``t`` over every rank, ``t`` left as it was.

Start exercise NN from a copy of this package (``grader/checks/exNN_slug/``) and of its drivers
(``grader/rank/drivers/ex00_template.py`` as ``grader/rank/drivers/exNN_slug.py``), or fold the package's three
files into one module ``grader/checks/exNN_slug.py``. Its catalog entry, stub and answers are in
``tests/template/``, and ``tests/test_template.py`` grades them, so the template always runs.

Rank side (``grader/rank/drivers/ex00_template.py``, the only code of an exercise a sandbox holds): each rank
builds its tensor, calls the learner's function in the grader's own process group and records what came back,
as plain data; it decides nothing and holds no answer. Grader side, here: the expected sum (``reference.py``),
then one verdict per check of the catalog (``verdicts.py``), from the ranks' records.
"""

from __future__ import annotations

from grader.rank.drivers.ex00_template import rank_main
from grader.checks.ex00_template.reference import expected_sum
from grader.checks.ex00_template.verdicts import check_input_kept, check_sum
from grader.checks.interface import Grader


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        records = g.run(rank_main, world_size).results()  # one record per rank, in rank order
        check_sum(g, records, expected_sum(world_size), world_size)
        check_input_kept(g, records, world_size)
