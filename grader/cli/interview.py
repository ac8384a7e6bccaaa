"""``ddp-grade interview``: a timed mock interview, one exercise and then a few quiz questions."""

from __future__ import annotations

import os
import sys

import click

from grader import flow, kit
from grader.cli.common import color, echo_notes, fail, kit_call, load_progress
from grader.cli.options import grading_options
from grader.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNUSABLE


@click.command()
@click.option("--exercise", "exercise_id", metavar="NN", help="This exercise (default: the first not passed).")
@click.option("--minutes", type=click.FloatRange(min=0.1, max=600), default=None,
              help="Time for the code (default: the exercise's budget from the catalog).")
@click.option("--questions", "n_questions", type=click.IntRange(min=0, max=20), default=3, show_default=True,
              help="Quiz questions after the code.")
@click.option("--seed", type=int, default=None, help="Seed for choosing the questions.")
@click.option("--track", type=click.Choice(["any", "write", "debug"]), default="any", show_default=True,
              help="Draw from the writing exercises, the debugging track (a broken job to fix), or either "
                   "(catalog order: the debugging track once every writing exercise has passed).")
@grading_options
def interview(exercise_id, minutes, n_questions, seed, track, options):
    """A timed mock interview: one exercise not yet passed, then a few quiz questions.

    The clock starts at once. Edit the exercise file in your editor; press Enter to
    grade, h for a hint (counted in the summary), q to finish. It ends with a final
    grading, the questions, the time used and a summary. With --track debug the exercise
    is a broken training job: "our DDP job hangs after the first epoch, what do you check?"
    """
    from grader import grading
    from grader.rank import harness
    from grader.commands import interview as iv
    from grader.report import render_text
    from grader.state import StateFile

    progress = load_progress()
    if exercise_id:
        ex = kit_call(lambda: kit.require_exercise(exercise_id))
    else:
        ex = kit_call(lambda: iv.pick_exercise(progress, lambda e: kit.exercise_path(e).exists(), track))
        if ex is None:
            which = "every exercise" if track == "any" else f"every exercise of the {track} track"
            fail(f"{which} has passed; pick one with --exercise NN", EXIT_UNUSABLE)
    path = str(kit_call(lambda: kit.exercise_path(ex)))
    if not os.path.exists(path):
        fail(f"no such file: {path} (`ddp-grade reset {ex.id}` puts the stub back)")
    quiz_state = StateFile("quiz.json")
    from grader.quiz.session import clean_progress

    questions = iv.pick_questions(ex, n_questions, seed if seed is not None else iv.default_seed(),
                                  clean_progress(quiz_state.load()))
    grading.warm_up(dynamo=ex.preload_dynamo, exercises=[ex])

    def read_line(prompt: str) -> str:
        click.echo(prompt, nl=False)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line

    with harness.Session(limits=options.limits, spares=True) as session:
        run = iv.Interview(
            ex, path, minutes if minutes is not None else ex.minutes, questions,
            grade=lambda: echo_notes(flow.grade_and_record(path, None, progress, flow.here(session, options, path, None)),
                                     progress),
            read_line=read_line, echo=click.echo, render_report=lambda r: render_text(r, color=color()),
            progress=progress, quiz_state=quiz_state)
        try:
            out = run.run()
        except KeyboardInterrupt:
            click.echo("\nInterview stopped.")
            raise SystemExit(EXIT_INTERRUPTED)
    click.echo(iv.summary(out))
    raise SystemExit(EXIT_OK if out.passed else EXIT_FAILED)
