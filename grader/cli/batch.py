"""``ddp-grade batch PATH...`` and ``ddp-grade batch merge FILE...``: grade many submissions
(:mod:`grader.batch`), and put the outputs of ``--shard`` runs back together (:mod:`grader.shards`)."""

from __future__ import annotations

import os
import sys

import click

from grader import batch as batching
from grader.batch_output import (Outcome, render_csv, render_json, render_junit, render_markdown, render_table,
                                 worst_status)
from grader.cli.options import format_option, grading_options, quiet_option
from grader.exits import EXIT_INTERRUPTED, EXIT_UNUSABLE
from grader.results import EXIT_CODES


class _BatchGroup(click.Group):
    """``batch PATH...`` grades (the ``grade`` subcommand); ``batch merge FILE...`` merges shards."""

    def parse_args(self, ctx, args):
        if not args or args[0] not in self.commands:  # --help too: the grading command's options
            args = ["grade", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_BatchGroup)
def batch():
    """Grade many submissions: files, folders of NN_*.py files, or folders of learners' folders.

    `ddp-grade batch PATH...` is `ddp-grade batch grade PATH...`; `ddp-grade batch merge FILE...`
    puts the JSON outputs of `--shard I/N` runs back together.
    """


@batch.command("grade")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--exercise", "exercise_id", metavar="NN",
              help="Grade only exercise NN (files in folders: NN_*.py; a file named directly is graded as NN).")
@click.option("-j", "--jobs", type=click.IntRange(min=1, max=64), default=None,
              help="Submissions graded at the same time (default: a quarter of the CPU cores, at least 2).")
@click.option("--shard", "shard_text", metavar="I/N",
              help="Grade only part I of N (1 <= I <= N), split by sorted submission name, the same on every "
                   "machine; `ddp-grade batch merge` combines the parts' outputs.")
@click.option("--sandbox/--no-sandbox", default=None,
              help="Grade each submission in a sandbox of its own (loopback only, home folder hidden, nothing "
                   "outlives it). On by default when bwrap or unshare works here. Unless --no-sandbox is given, "
                   "a check that passed on what the submission's processes recorded about themselves is claimed, "
                   "not counted.")
@grading_options
@format_option("text", "json", "csv", "markdown")
@click.option("-o", "--output", "output_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write the JSON output to FILE (what `batch merge` reads).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write JUnit XML to FILE: one test suite per submission.")
@quiet_option
def grade_many(paths, exercise_id, jobs, shard_text, sandbox, options, fmt, output_path, junit_path, quiet):
    """Grade many submissions: files, folders of NN_*.py files, or folders of learners' folders.

    One bad submission (a crash, a hang, a missing file) never stops the rest;
    the exit code is the worst result: 2 (could not grade one) > 3 (timeout) > 1 (failed) > 0.
    `ddp-grade batch merge FILE...` combines the -o outputs of --shard runs.

    \b
    Examples:
      ddp-grade batch submissions/ --exercise 03 --jobs 2
      ddp-grade batch alice/ bob/ --format csv > results.csv
      ddp-grade batch submissions/ --shard 2/8 -o results/shard-2.json
    """
    from grader import catalog, live, shards

    if exercise_id is not None:
        exercise_id = exercise_id.zfill(2)
        if catalog.by_id(exercise_id) is None:
            known = ", ".join(e.id for e in catalog.exercises())
            raise click.UsageError(f"unknown exercise {exercise_id!r}: choose one of {known}")
    shard = None
    if shard_text is not None:
        try:
            shard = shards.parse(shard_text)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    _check_writable(output_path, junit_path)
    line = None
    try:
        tool = _sandbox_tool(sandbox)
        submissions = batching.collect(list(paths), exercise_id)
        record = None
        if shard is not None:
            names = [s.name for s in submissions]
            record = shards.record(names, shard)
            submissions = [submissions[k] for k in shards.positions(names, shard)]
        line = live.BatchLine(len(submissions), live.mode_for(sys.stderr, quiet))
        outcomes = batching.run_batch(submissions, jobs or batching.default_jobs(), options.to_dict(),
                             on_done=lambda o: line.finish(o.submission.name, o.status),
                             on_start=lambda s: line.begin(s.name), sandbox=tool, claims_count=sandbox is False)
    except KeyboardInterrupt:
        if line is not None:
            line.done()
        click.echo("interrupted: the workers were stopped", err=True)
        raise SystemExit(EXIT_INTERRUPTED)
    line.done()
    _emit(outcomes, fmt, output_path, junit_path, record)
    if shard is not None and fmt == "text":
        click.echo(f"(shard {shard}: {len(outcomes)} of the {len(record['submissions'])} submissions)")
    raise SystemExit(EXIT_CODES[worst_status(outcomes)])


@batch.command("merge")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=str))
@format_option("text", "json", "csv", "markdown")
@click.option("-o", "--output", "output_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write the merged JSON output to FILE.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write JUnit XML to FILE: one test suite per submission.")
def merge(files, fmt, output_path, junit_path):
    """Combine the JSON outputs of `ddp-grade batch --shard I/N` runs into one result.

    Every shard 1/N ... N/N must be given once. Outputs that overlap (a shard twice), a
    missing shard, or shards cut from different submissions or into different counts are
    refused with exit 2 and a message naming the files, before anything is written.
    Otherwise the exit code is the worst result, as for the whole batch graded at once.

    \b
    Example:
      ddp-grade batch merge results/shard-*.json --format csv > results.csv
    """
    from grader import batch_output, shards

    _check_writable(output_path, junit_path)
    pieces = []
    for name in files:
        try:
            with open(name, encoding="utf-8") as f:
                outcomes, shard_field = batch_output.read_json(f.read())
            pieces.append(shards.piece(name, outcomes, shard_field))
        except OSError as exc:
            _fail(f"cannot read {name}: {exc.strerror or exc}")
        except shards.MergeError as exc:
            _fail(str(exc))
        except ValueError as exc:
            _fail(f"{name}: {exc.args[0] if exc.args else exc} (write shard outputs with -o FILE or --format json)")
    try:
        merged = shards.merge(pieces)
    except shards.MergeError as exc:
        _fail(str(exc))
    _emit(merged, fmt, output_path, junit_path, None)
    raise SystemExit(EXIT_CODES[worst_status(merged)])


def _emit(outcomes: list[Outcome], fmt: str, output_path: str | None, junit_path: str | None,
          shard: dict | None) -> None:
    """Print the result in ``fmt``; write the JSON and JUnit files asked for."""
    files = ((output_path, lambda: render_json(outcomes, shard)), (junit_path, lambda: render_junit(outcomes)))
    for path, text in files:
        if path:
            try:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text() + ("" if path == junit_path else "\n"))
            except OSError as exc:
                _fail(f"cannot write {path}: {exc.strerror or exc}")
    if fmt == "json":
        click.echo(render_json(outcomes, shard))
    elif fmt == "csv":
        click.echo(render_csv(outcomes), nl=False)
    elif fmt == "markdown":
        click.echo(render_markdown(outcomes), nl=False)
    else:
        click.echo(render_table(outcomes))


def _check_writable(*paths: str | None) -> None:
    """Refuse at once, not after an hour of grading, an output file that cannot be written."""
    for path in paths:
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                _fail(f"cannot write {path}: no folder {folder}")
            if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
                _fail(f"cannot write {path}: permission denied")


def _sandbox_tool(asked: bool | None) -> str | None:
    """The sandbox tool to use: asked for (--sandbox: refuse without one), refused (--no-sandbox), or default."""
    from grader import sandbox

    if asked is False:
        return None
    found = sandbox.tool()
    if found is None:
        if asked:
            _fail("--sandbox needs bwrap (the bubblewrap package) or unshare with user namespaces; neither "
                  "works here (see `ddp-grade doctor`)")
        click.echo("ddp-grade: no sandbox here (neither bwrap nor unshare works): grading without one. "
                   "Install bubblewrap, or pass --no-sandbox to grade unsandboxed without this notice.", err=True)
    return found


def _fail(message: str) -> None:
    click.echo(f"ddp-grade: error: {message}", err=True)
    raise SystemExit(EXIT_UNUSABLE)

