"""``ddp-grade quiz`` through click's CliRunner: scripted and interactive runs, bad input, state file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import grader.quiz.command as command
from grader.cli import main
from grader.quiz.bank import LETTERS, TOPICS, load_bank, topic_counts

BANK_BY_ID = {q.id: q for q in load_bank()}


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "state"
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(folder))
    return folder


def quiz(*args: str, input: str | None = None):
    return CliRunner().invoke(main, ["quiz", *args], input=input)


def quiz_json(*args: str, input: str | None = None) -> dict:
    result = quiz(*args, "--format", "json", input=input)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_clean_failure(result, message: str, code: int = 2):
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert message in result.output


def saved_state(state_dir: Path) -> dict:
    return json.loads((state_dir / "quiz.json").read_text(encoding="utf-8"))


def probe_quiz(tmp_path: Path, *args: str) -> list[dict]:
    """The questions a run would ask, found in a separate state folder (so the real one is untouched)."""
    n = int(args[args.index("-n") + 1])
    result = CliRunner(env={"DDP_GRADE_STATE_DIR": str(tmp_path / "probe")}).invoke(
        main, ["quiz", *args, "--format", "json", "--answers", " ".join("a" * n)])
    return json.loads(result.stdout)["questions"]


def wrong_letter(entry: dict) -> str:
    """A letter that makes this question wrong."""
    return next(letter for letter in LETTERS[: len(entry["choices"])] if letter not in entry["correct"])


# --- scripted runs ---------------------------------------------------------------------------------

def test_scripted_quiz_prints_a_score_and_exits_0(state_dir):
    result = quiz("-n", "5", "--seed", "1", "--answers", "a,b,c,a,b")
    assert result.exit_code == 0, result.output
    assert "Overall:" in result.output and "/5" in result.output
    assert "Score per topic:" in result.output
    assert "Source:" in result.output


def test_same_seed_gives_same_questions_and_choice_order(tmp_path, monkeypatch):
    runs = []
    for name in ("one", "two"):
        monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / name))
        runs.append(quiz_json("-n", "6", "--seed", "7", "--answers", "a a a a a a"))
    first, second = ([(q["id"], q["choices"]) for q in run["questions"]] for run in runs)
    assert first == second
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "three"))
    other = quiz_json("-n", "6", "--seed", "8", "--answers", "a a a a a a")
    assert [(q["id"], q["choices"]) for q in other["questions"]] != first


def test_choices_are_shuffled_by_the_seed(state_dir):
    run = quiz_json("-n", "20", "--seed", "3", "--answers", " ".join("a" * 20))
    assert any(q["choices"] != list(BANK_BY_ID[q["id"]].choices) for q in run["questions"])
    for q in run["questions"]:
        assert sorted(q["choices"]) == sorted(BANK_BY_ID[q["id"]].choices)


def test_json_schema(state_dir):
    run = quiz_json("-n", "3", "--seed", "1", "--answers", "a,b,c")
    assert set(run) == {"schema", "seed", "completed", "questions", "summary"}
    assert run["schema"] == "ddp-grade.quiz/1" and run["seed"] == 1 and run["completed"] is True
    assert [q["given"] for q in run["questions"]] == ["a", "b", "c"]
    for number, q in enumerate(run["questions"], 1):
        assert set(q) == {"number", "id", "topic", "difficulty", "multi", "choices", "given", "correct",
                          "right", "source"}
        assert q["number"] == number and q["id"] in BANK_BY_ID
        assert q["right"] == (q["given"] == q["correct"])
    summary = run["summary"]
    assert set(summary) == {"planned", "answered", "right", "wrong", "per_topic"}
    assert summary["planned"] == summary["answered"] == 3
    assert summary["right"] == sum(q["right"] for q in run["questions"])
    assert sum(t["right"] for t in summary["per_topic"].values()) == summary["right"]
    assert sum(t["answered"] for t in summary["per_topic"].values()) == 3


def test_correct_answers_score_full_marks(state_dir, tmp_path):
    entries = probe_quiz(tmp_path, "-n", "8", "--seed", "11")
    run = quiz_json("-n", "8", "--seed", "11", "--answers", ",".join(q["correct"] for q in entries))
    assert run["summary"]["right"] == 8


def test_answers_from_a_file(state_dir, tmp_path):
    answers = tmp_path / "answers.txt"
    answers.write_text("# my answers\na\n\nb, c\nd  # last\n", encoding="utf-8")
    for value in (f"@{answers}", str(answers)):
        run = quiz_json("-n", "3", "--seed", "2", "--topic", "launch", "--answers", value)
        assert [q["given"] for q in run["questions"]] == ["a", "bc", "d"]


def test_topic_and_difficulty_filters(state_dir):
    run = quiz_json("-n", "4", "--seed", "1", "--topic", "sampler", "--topic", "core,launch",
                    "--difficulty", "hard", "--answers", "a a a a")
    assert {q["topic"] for q in run["questions"]} <= {"sampler", "core", "launch"}
    assert {q["difficulty"] for q in run["questions"]} == {"hard"}


def test_count_larger_than_the_pool_asks_every_matching_question(state_dir):
    pool = [q for q in BANK_BY_ID.values() if q.topic == "checkpoint"]
    run = quiz_json("-n", "50", "--topic", "checkpoint", "--answers", " ".join("a" * len(pool)))
    assert len(run["questions"]) == len(pool)


# --- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "args, message",
    [
        (["--topic", "gossip"], "unknown topic 'gossip'; valid topics: " + ", ".join(TOPICS)),
        (["--topic", "core,nope"], "unknown topic 'nope'"),
        (["-n", "0"], "-n/--count must be at least 1 (got 0)"),
        (["-n", "-3"], "-n/--count must be at least 1 (got -3)"),
        (["--difficulty", "brutal"], "unknown difficulty 'brutal'; choose from easy, medium, hard"),
        (["-n", "3", "--seed", "1", "--answers", "a,b"], "too few answers: got 2 for 3 questions"),
        (["-n", "2", "--seed", "1", "--answers", "a,b,c"], "too many answers: got 3 for 2 questions"),
        (["-n", "3", "--seed", "1", "--answers", "a,q,b"], "answer 2 ('q'): 'q' is not a choice"),
        (["-n", "2", "--seed", "1", "--answers", "a,b9"], "answer 2 ('b9'): '9' is not a choice"),
        (["--answers", "@/no/such/answers.txt"], "cannot read answers file"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(state_dir, args, message):
    result = quiz(*args)
    assert_clean_failure(result, message)
    assert not (state_dir / "quiz.json").exists()  # nothing was recorded


def test_letter_beyond_a_questions_choices_is_rejected(state_dir, tmp_path):
    entries = probe_quiz(tmp_path, "-n", "30", "--seed", "4")
    number, entry = next((i, q) for i, q in enumerate(entries, 1) if len(q["choices"]) < 5)
    letter = LETTERS[len(entry["choices"])]
    answers = ["a"] * 30
    answers[number - 1] = letter
    result = quiz("-n", "30", "--seed", "4", "--answers", ",".join(answers))
    assert_clean_failure(result, f"answer {number} ('{letter}'): '{letter}' is not a choice")


def test_malformed_answers_file_exits_2(state_dir, tmp_path):
    bad = tmp_path / "answers.bin"
    bad.write_bytes(b"\xff\xfe\x00a\n")
    assert_clean_failure(quiz("-n", "1", "--answers", f"@{bad}"), "cannot read answers file")


# --- interactive runs ------------------------------------------------------------------------------

def test_interactive_quiz_reasks_after_an_invalid_letter(state_dir):
    result = quiz("-n", "1", "--seed", "1", input="z\n\na\n")
    assert result.exit_code == 0, result.output
    assert "'z' is not a choice" in result.output and "try again" in result.output
    assert "no answer given" in result.output
    assert "Overall:" in result.output


def test_interactive_multi_letter_answer(state_dir):
    result = quiz("-n", "1", "--seed", "1", "--format", "json", input="a,c\n")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["questions"][0]["given"] == "ac"


def test_ctrl_c_saves_answers_so_far_and_exits_130(state_dir, monkeypatch):
    replies = iter(["a\n", "b\n"])

    def fake_read_line(prompt, err=False):
        try:
            return next(replies)
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(command, "read_line", fake_read_line)
    result = quiz("-n", "5", "--seed", "2")
    assert result.exit_code == 130
    assert "Interrupted after 2 of 5 questions" in result.output
    assert "Overall:" in result.output and "/2" in result.output
    saved = saved_state(state_dir)
    assert len(saved["questions"]) == 2 and saved["seq"] == 2
    assert sorted(r["given"] for r in saved["questions"].values()) == ["a", "b"]


def test_state_is_saved_after_every_answer(state_dir, monkeypatch):
    seen_counts = []

    def fake_read_line(prompt, err=False):
        path = state_dir / "quiz.json"
        seen_counts.append(len(saved_state(state_dir)["questions"]) if path.exists() else 0)
        return "a\n"

    monkeypatch.setattr(command, "read_line", fake_read_line)
    assert quiz("-n", "4", "--seed", "3").exit_code == 0
    assert seen_counts == [0, 1, 2, 3]
    assert len(saved_state(state_dir)["questions"]) == 4


def test_end_of_input_stops_like_an_interrupt(state_dir):
    result = quiz("-n", "3", "--seed", "1", "--format", "json", input="a\n")
    assert result.exit_code == 130
    run = json.loads(result.stdout)
    assert run["completed"] is False and run["summary"]["answered"] == 1 and run["summary"]["planned"] == 3
    assert len(saved_state(state_dir)["questions"]) == 1


# --- state file ------------------------------------------------------------------------------------

def test_corrupt_state_file_is_kept_aside_and_the_quiz_still_runs(state_dir):
    state_dir.mkdir(parents=True)
    (state_dir / "quiz.json").write_text("{not json", encoding="utf-8")
    result = quiz("-n", "2", "--seed", "1", "--answers", "a,b")
    assert result.exit_code == 0, result.output
    aside = list(state_dir.glob("quiz.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text(encoding="utf-8") == "{not json"
    assert "could not be read" in result.stderr
    assert len(saved_state(state_dir)["questions"]) == 2


def test_state_of_the_wrong_shape_is_ignored(state_dir):
    state_dir.mkdir(parents=True)
    (state_dir / "quiz.json").write_text('{"questions": [1, 2], "seq": "x"}', encoding="utf-8")
    assert quiz("-n", "1", "--answers", "a").exit_code == 0


def test_review_asks_only_previously_wrong_questions_most_recent_first(state_dir, tmp_path):
    entries = probe_quiz(tmp_path, "-n", "4", "--seed", "5")
    answers = [wrong_letter(entries[0]), entries[1]["correct"], wrong_letter(entries[2]), entries[3]["correct"]]
    first = quiz_json("-n", "4", "--seed", "5", "--answers", ",".join(answers))
    assert [q["right"] for q in first["questions"]] == [False, True, False, True]

    review = quiz_json("--review", "--seed", "9", "--answers", "a a")
    assert [q["id"] for q in review["questions"]] == [entries[2]["id"], entries[0]["id"]]

    mixed = quiz_json("-n", "3", "--seed", "9", "--answers", "a a a")
    wrong_now = {q["id"] for q in review["questions"] if not q["right"]}
    asked = [q["id"] for q in mixed["questions"]]
    assert set(asked[: len(wrong_now)]) == wrong_now  # previously wrong come first
    assert not ({entries[1]["id"], entries[3]["id"]} & set(asked))  # right ones wait behind unseen ones


def test_review_with_nothing_wrong_says_so_and_exits_0(state_dir):
    result = quiz("--review")
    assert result.exit_code == 0
    assert "Nothing to review" in result.output


def test_list_topics(state_dir):
    result = quiz("--list-topics")
    assert result.exit_code == 0
    counts = topic_counts(list(BANK_BY_ID.values()))
    lines = result.output.strip().splitlines()
    assert len(lines) == len(TOPICS)
    for line, topic in zip(lines, TOPICS):
        name, count = line.split()[:2]
        assert name == topic and int(count) == counts[topic]


def test_help_mentions_the_options():
    result = CliRunner().invoke(main, ["quiz", "--help"])
    assert result.exit_code == 0
    for option in ("--topic", "--count", "--difficulty", "--seed", "--answers", "--format", "--review",
                   "--list-topics"):
        assert option in result.output
