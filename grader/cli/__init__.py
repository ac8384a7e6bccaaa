"""The ``ddp-grade`` command line: the group, and one module per command beside it (every click decorator of
the kit is in this package). Commands only parse options and render; the work is elsewhere.

Exit codes (every command):
  0  everything passed / the command did what was asked
  1  a check failed
  2  the input could not be used: missing path, syntax error, missing function,
     unknown exercise or topic, bad option value, unreadable answers file
  3  grading timed out (a deadlock or an endless loop in the submission)
  130 interrupted with Ctrl-C (progress so far is saved); `watch` ends with 0 on Ctrl-C,
      its normal way to stop

Per command: `list`, `hint`, `solution`, `reset`, `restore` exit 0 or 2 (unknown exercise,
kit files not found, a copy that cannot be kept); `server status` and `server stop` exit 0; `doctor` exits 0 when grading can work here, 1 when something is wrong;
`interview` exits 0 when the exercise passed at the end, 1 when not, 130 on Ctrl-C;
`batch` and `batch merge` exit with the worst result of the submissions (2 > 3 > 1 > 0; merge: 2 when
it refuses its parts); `gradescope run` exits 0 whenever it wrote results.json, 2 when the bundle
cannot be used; `plan` exits 0 when the cost model answered, 1 while 41 and 42 have not both passed,
2 for a plan or option it cannot use.
"""

from __future__ import annotations

import click

from grader import __version__
from grader.cli import (batch, doctor, grade, gradescope, hint, interview, listing, plan, quiz, reset,
                                restore, server, solution, watch)


class DefaultGroup(click.Group):
    """A group where ``ddp-grade PATH`` means ``ddp-grade grade PATH``."""

    default_command = "grade"

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = [self.default_command, *args]
        elif not args and self.default_command in self.commands:
            args = [self.default_command]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ddp-grade")
def main():
    """Practise PyTorch DDP: write the exercises, get them graded in real process groups.

    \b
    Examples:
      ddp-grade                           grade the next unfinished exercise
      ddp-grade list                      every exercise and its status
      ddp-grade watch                     re-grade the next exercise on every save
      ddp-grade hint 03                   the next hint for exercise 03
      ddp-grade exercises/03_train.py     grade one file (also: ddp-grade 03)
      ddp-grade interview --minutes 45    a timed mock interview
      ddp-grade quiz -n 5                 five quiz questions
      ddp-grade doctor                    check that grading works on this machine
    """


for command in (grade.grade, listing.list_command, hint.hint, watch.watch, solution.solution, reset.reset,
                restore.restore, interview.interview, doctor.doctor, server.server_group, quiz.quiz, batch.batch,
                gradescope.gradescope, plan.plan_command):
    main.add_command(command)
