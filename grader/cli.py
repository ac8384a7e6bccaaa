"""The ``ddp-grade`` command line. Commands only parse options and render; the work is elsewhere.

Exit codes (every command):
  0  everything passed / the command did what was asked
  1  a check failed (or a quiz answer was wrong, for scripted quizzes)
  2  the input could not be used: missing path, syntax error, missing function,
     unknown exercise or topic, bad option value, unreadable answers file
  3  grading timed out (a deadlock or an endless loop in the submission)
  130 interrupted with Ctrl-C (progress so far is saved)
"""

from __future__ import annotations

import click

from grader import __version__

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNUSABLE = 2
EXIT_TIMEOUT = 3
EXIT_INTERRUPTED = 130


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
      ddp-grade exercises/03_train.py     grade one file
      ddp-grade quiz -n 5                 five quiz questions
    """


# Subcommands that live in their own modules, one line each.
from grader.quiz.command import quiz  # noqa: E402

main.add_command(quiz)
