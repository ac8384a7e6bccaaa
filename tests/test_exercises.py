"""Every exercise in the catalog: stub, solution and checks agree with each other."""

from __future__ import annotations

import ast

import pytest

import background
from conftest import ROOT, statuses
from grader import catalog
from grader import timeline as T
from grader.report import details_of, problem_of

EXERCISES = catalog.exercises()
IDS = [ex.id for ex in EXERCISES]
WRITING = [ex for ex in EXERCISES if not ex.is_debug]
DEBUGGING = [ex for ex in EXERCISES if ex.is_debug]
# The stubs as shipped: exercises/ is the learner's copy, and may hold their work.
SHIPPED = ROOT / "grader" / "stubs"


def _signatures(path) -> dict:
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = ast.unparse(node.args)
        elif isinstance(node, ast.ClassDef):
            out[node.name] = "class"
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_") or \
                        isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    out[f"{node.name}.{item.name}"] = ast.unparse(item.args)
    return out


# --- what a reference's timeline shows -----------------------------------------------------------------------
# The exercises whose checks record what each rank did over time, and, where the picture is the point, what
# it shows for the reference (tests/test_timeline.py holds 08, 13 and 16 against wrong answers too).
RECORD_TIMELINES = {"03", "05", "06", "07", "08", "09", "10", "11", "12", "13", "14", "16", "17", "18", "19", "20",
                    "21", "22", "23", "24", "25", "26", "27", "28", "29", "31", "32", "33", "34", "35", "36", "37",
                    "51", "52", "53"}


def _inside(event: dict, phases: list[dict]) -> bool:
    return any(p["t0"] <= event["t0"] <= p["t1"] for p in phases)


def _experts_trade_tokens_in_forward_and_backward(run: dict, rank: int) -> None:
    """17: the all-to-alls that send tokens to their experts run inside the forward and inside the backward."""
    within = "plain"
    swaps = [e for e in T.events(run, rank, ("collective",), within) if "all_to_all" in e["op"]]
    for phase in ("forward", "backward"):
        assert any(_inside(e, T.events(run, rank, (phase,), within)) for e in swaps), (rank, phase, swaps)


def _units_gather_in_forward_and_scatter_in_backward(run: dict, rank: int) -> None:
    """31: each step, FSDP2's all-gathers run inside the forward, its reduce-scatters inside the backward."""
    if run["world_size"] < 2:
        return
    for step in range(3):
        within = f"train_step {step}"
        comms = T.events(run, rank, ("collective",), within)
        forwards, backwards = T.events(run, rank, ("forward",), within), T.events(run, rank, ("backward",), within)
        gathers = [e for e in comms if "all_gather" in e["op"]]
        scatters = [e for e in comms if "reduce_scatter" in e["op"]]
        assert gathers and scatters and forwards and backwards, (rank, step)
        assert _inside(gathers[0], forwards) and all(_inside(e, backwards) for e in scatters), (rank, step)


def _saves_write_while_training_goes_on(run: dict, rank: int) -> None:
    """33's save job: a save returns, and its collectives go on in another thread while the job trains."""
    if not run["label"].startswith("the save job"):
        return
    events = T.events(run, rank)
    calls = [e for e in events if e["kind"] == "save" and e.get("label", "").startswith("save, step")]
    assert calls, rank
    main = calls[0].get("thread", 0)  # the main thread is 0, left out of the record
    later = [e for e in events if e["kind"] == "forward" and e.get("thread", 0) == main and e["t0"] > calls[0]["t1"]]
    background_comms = [e for e in events if e["kind"] == "collective" and e.get("thread", 0) != main
                        and e["t0"] > calls[0]["t1"]]
    assert later and background_comms, rank
    assert background_comms[0]["t0"] < later[-1]["t1"], "the background save outlives the training"


def _collectives_in_flight_across_backward(run: dict, rank: int) -> None:
    """51: in a step, every all-gather and reduce-scatter is issued asynchronously, and every reduce-scatter is
    waited for after the backward ends."""
    if run["world_size"] < 2:
        return
    within = "step 2"
    comms = T.events(run, rank, ("collective",), within)
    waits = T.events(run, rank, ("wait",), within)
    backward = T.events(run, rank, ("backward",), within)
    gathers = [e for e in comms if "all_gather" in e["op"]]
    scatters = [e for e in comms if "reduce_scatter" in e["op"]]
    assert gathers and scatters and backward and all(e.get("async") for e in gathers + scatters), rank
    assert all(w["t0"] >= backward[-1]["t1"] for w in waits if w.get("label", "").startswith("reduce_scatter")), rank


def _ring_sends_to_one_neighbour_in_forward(run: dict, rank: int) -> None:
    """53: allgather_matmul's forward sends W - 1 chunks, all to the next rank, each waited for later."""
    within = "world: allgather_matmul"
    size = run["world_size"]
    forward = T.events(run, rank, ("forward",), within)
    sends = [e for e in T.events(run, rank, ("send",), within) if _inside(e, forward)]
    assert len(sends) == size - 1 and {e.get("peer") for e in sends} <= {(rank + 1) % size}, (rank, sends)


TIMELINE_SHOWS = {"17": _experts_trade_tokens_in_forward_and_backward,
                  "31": _units_gather_in_forward_and_scatter_in_backward,
                  "33": _saves_write_while_training_goes_on,
                  "51": _collectives_in_flight_across_backward,
                  "53": _ring_sends_to_one_neighbour_in_forward}


def check_timelines(exercise_id: str, report) -> None:
    runs = T.runs_in([dict(s) for s in report.sections])
    if exercise_id not in RECORD_TIMELINES:
        assert runs == [], f"{exercise_id} records a timeline: add it to RECORD_TIMELINES"
        return
    assert runs, f"{exercise_id}'s reference recorded no timeline"
    for run in runs:
        for rank in range(run["world_size"]):
            assert T.events(run, rank), (run["label"], rank)
            if exercise_id in TIMELINE_SHOWS:
                TIMELINE_SHOWS[exercise_id](run, rank)


def _python_files(folder) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*.py")}


def test_catalog_files_exist_and_nothing_is_uncatalogued():
    names = {ex.filename for ex in EXERCISES}
    assert _python_files(ROOT / "exercises") == names
    assert _python_files(ROOT / "solutions") == names
    for ex in EXERCISES:  # its checks: a module or a package (tests/test_contributing.py holds their shape)
        checks = ROOT / "grader" / "checks" / f"ex{ex.id}_{ex.slug}"
        assert checks.with_suffix(".py").exists() or (checks / "__init__.py").exists(), ex.id


def test_catalog_ids_are_unique_and_every_check_has_a_title_and_hint():
    assert len(set(IDS)) == len(IDS)
    for ex in EXERCISES:
        ids = [c.id for c in ex.checks]
        assert len(set(ids)) == len(ids), ex.id
        assert ex.checks and ex.hints and ex.functions
        for c in ex.checks:
            assert c.title and c.hint, (ex.id, c.id)
            assert set(c.after) <= set(ids) - {c.id}, (ex.id, c.id, c.after)


def test_every_exercise_names_quiz_topics_that_exist():
    from grader.quiz.bank import load_bank

    topics = {q.topic for q in load_bank()}
    for ex in EXERCISES:
        assert ex.quiz_topics, ex.id
        assert set(ex.quiz_topics) <= topics, (ex.id, set(ex.quiz_topics) - topics)


@pytest.mark.parametrize("exercise", EXERCISES, ids=IDS)
def test_stub_and_solution_have_the_same_signatures(exercise):
    stub = _signatures(SHIPPED / exercise.filename)
    solution = _signatures(ROOT / "solutions" / exercise.filename)
    for name in exercise.functions:
        assert name in stub and name in solution
    assert {k: v for k, v in stub.items() if k in solution} == {k: solution[k] for k in stub if k in solution}


@pytest.mark.parametrize("exercise", WRITING, ids=[ex.id for ex in WRITING])
def test_every_stub_body_is_a_todo(exercise):
    text = (SHIPPED / exercise.filename).read_text()
    assert text.lstrip().startswith('"""'), "a stub starts with its task statement"
    assert "raise NotImplementedError" in text and "# TODO" in text


@pytest.mark.slow
@pytest.mark.parametrize("exercise", [
    pytest.param(ex, id=ex.id, marks=[background.grading(ROOT / "solutions" / ex.filename)]
                 if background.waits(ex.filename) else []) for ex in EXERCISES])
def test_solution_passes_every_check(grade, exercise):
    report = grade(ROOT / "solutions" / exercise.filename)
    failing = {c.id: c.message for c in report.checks if c.status not in ("pass", "skip")}
    assert report.status == "passed", (problem_of(report), failing, details_of(report))
    assert report.exit_code == 0
    check_timelines(exercise.id, report)
    # The header names what ran: the world sizes of the groups that ran, or one process.
    if report.in_one_process:
        assert report.world_sizes == []
    else:
        assert report.world_sizes and set(report.world_sizes) <= set(exercise.world_sizes) | {1}


# Where one rank has nothing to show: the grading stops at once and says which world size to ask for.
NEEDS_TWO_RANKS = {"28", "34"}


@pytest.mark.slow
@pytest.mark.parametrize("exercise", EXERCISES, ids=IDS)
def test_solution_at_world_size_one_passes_or_asks_for_two_ranks(grade, exercise):
    """--world-size 1 (watch's tests use it, and a learner may): no check the reference fails for want of a second
    rank. A check that needs one skips, or the exercise asks for 2 ranks before running anything."""
    report = grade(ROOT / "solutions" / exercise.filename, world_size=1)
    if exercise.id in NEEDS_TWO_RANKS:
        assert report.status == "failed" and "--world-size 2 or more" in problem_of(report), problem_of(report)
        assert not [c for c in report.checks if c.status in ("pass", "fail")]
        return
    failing = {c.id: c.message for c in report.checks if c.status not in ("pass", "skip")}
    assert report.status == "passed", (problem_of(report), failing)


@pytest.mark.parametrize("exercise", DEBUGGING, ids=[ex.id for ex in DEBUGGING])
def test_every_broken_script_starts_with_a_report_and_differs_from_its_fix(exercise):
    """A debugging exercise ships a script that runs but misbehaves: no TODOs, a report at its top."""
    text = (SHIPPED / exercise.filename).read_text()
    assert text.lstrip().startswith('"""') and "Bug report" in text.split('"""')[1]
    assert "NotImplementedError" not in text and "# TODO" not in text
    assert ast.dump(ast.parse(text)) != ast.dump(ast.parse((ROOT / "solutions" / exercise.filename).read_text()))
    assert exercise.symptom and set(exercise.symptom) <= {c.id for c in exercise.checks}
    assert f"ddp-grade exercises/{exercise.filename}" in text


@pytest.mark.slow
@pytest.mark.parametrize("exercise", [  # each script as shipped hangs or runs to a deadline
    pytest.param(ex, id=ex.id, marks=background.grading(SHIPPED / ex.filename)) for ex in DEBUGGING])
def test_broken_script_as_shipped_shows_its_symptom(grade, exercise):
    """The grader reproduces the colleague's report: the symptom checks fail, saying what was observed."""
    report = grade(SHIPPED / exercise.filename)
    assert report.status == "failed" and report.exit_code == 1, (problem_of(report), details_of(report)[-2000:])
    got = statuses(report)
    for check_id in exercise.symptom:
        message = next(c.message for c in report.checks if c.id == check_id)
        assert got[check_id] == "fail" and message.strip() and not message.startswith("not checked"), \
            (check_id, got, message)
    # What the report says is what a colleague would see, and where: never the way to the fix, which
    # stays behind `ddp-grade hint` (the exercise's hints and every check's hint).
    from grader.report import render_json, render_text

    shown = render_text(report, verbose=True) + render_json(report)
    for hint in [*exercise.hints, *(c.hint for c in exercise.checks if c.hint)]:
        assert hint not in shown, hint
    assert all(c.hint == "" or c.likely_cause for c in report.checks), [(c.id, c.hint) for c in report.checks]
    # A check that could not be decided because another failed is shown as not checked, not failed.
    waiting = [c for c in report.checks if c.status == "not-checked"]
    assert all(c.likely_cause and got[c.likely_cause] == "fail" for c in waiting)
    decided = len(report.checks) - len(waiting) - list(got.values()).count("skip")
    assert f"/{decided} checks passed" in render_text(report)


@pytest.mark.slow
@pytest.mark.parametrize("exercise", WRITING, ids=[ex.id for ex in WRITING])
def test_stub_reports_not_implemented(grade, exercise):
    report = grade(SHIPPED / exercise.filename)
    assert report.exit_code == 1
    assert problem_of(report) and problem_of(report).startswith("not implemented yet: ")
    assert problem_of(report).split(": ", 1)[1] in exercise.functions or "." in problem_of(report)
    assert "pass" not in statuses(report).values()


def test_the_02_statement_says_why_its_halves_treat_the_remainder_differently():
    stub = (SHIPPED / "02_shard.py").read_text()
    assert "drops the remainder" in stub and "pads" in stub and "drop_last=True" in stub
