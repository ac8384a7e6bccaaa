"""``ddp-grade quiz``: multiple-choice questions on DDP in the terminal (:mod:`grader.quiz.terminal` asks them)."""

from __future__ import annotations

import click

from grader.exits import EXIT_UNUSABLE
from grader.quiz.bank import BankError
from grader.quiz.terminal import QuizInputError, run_quiz


@click.command()
@click.option("--topic", "topic_args", multiple=True, metavar="TOPIC",
              help="Only these topics (repeat the option or give a comma list). See --list-topics.")
@click.option("-n", "--count", type=int, default=10, show_default=True, help="Number of questions.")
@click.option("--difficulty", metavar="LEVEL", help="Only questions of this level: easy, medium or hard.")
@click.option("--seed", type=int, help="Seed for the question order and the choice order (reproducible quiz).")
@click.option("--answers", "answers_arg", metavar="ANSWERS",
              help='Answer without prompts: "a,bd,c" (one token per question), or @FILE for a file with '
                   'one answer per line (without @ the value is always letters, even if a file has that name).')
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: one object on stdout (see docs/quiz.md).")
@click.option("--review", is_flag=True, help="Only the questions whose latest answer was wrong, most recent first.")
@click.option("--list-topics", is_flag=True,
              help="List the topics with their question counts and the total, and exit (honours --format).")
@click.pass_context
def quiz(ctx, topic_args, count, difficulty, seed, answers_arg, fmt, review, list_topics):
    """Answer multiple-choice questions on DDP in the terminal.

    Type the letter of your choice; for "choose all that apply" questions type
    several letters (ac or a,c). Progress is saved after every answer; questions
    answered wrong come back first next time.

    \b
    Examples:
      ddp-grade quiz -n 5 --topic sampler,launch
      ddp-grade quiz --review
      ddp-grade quiz -n 3 --seed 1 --answers "a,b,c" --format json
    """
    try:
        code = run_quiz(topic_args, count, difficulty, seed, answers_arg, fmt, review, list_topics)
    except (QuizInputError, BankError) as exc:
        click.echo(f"ddp-grade quiz: error: {exc}", err=True)
        code = EXIT_UNUSABLE
    ctx.exit(code)
