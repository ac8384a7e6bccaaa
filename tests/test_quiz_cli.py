"""``ddp-grade quiz`` through click's CliRunner: scripted and interactive runs, bad input, state file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import grader.quiz.terminal as command
from grader.cli import main
from grader.quiz.bank import TOPICS, load_bank, topic_counts
from grader.quiz.question import LETTERS

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


def first_of_kind(tmp_path: Path, multi: bool, *args: str) -> tuple[str, dict]:
    """A seed whose first question is (or is not) multi-select, and that question's JSON entry."""
    for seed in range(200):
        entry = probe_quiz(tmp_path / str(seed), "-n", "1", "--seed", str(seed), *args)[0]
        if entry["multi"] == multi:
            return str(seed), entry
    raise AssertionError("no such question in the bank")


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
        assert set(q) == {"number", "id", "topic", "difficulty", "multi", "question", "choices", "given",
                          "correct", "right", "explanation", "source", "demo", "checked"}
        assert q["number"] == number and q["id"] in BANK_BY_ID
        assert q["right"] == (q["given"] == q["correct"])
        bank = BANK_BY_ID[q["id"]]
        assert q["question"] == bank.text and q["explanation"] == bank.explanation
        assert q["source"] == bank.source and q["checked"] == bank.checked and q["demo"] == (bank.demo or None)
        # The right letters name the bank's right choices, in the order shown.
        assert {q["choices"][LETTERS.index(c)] for c in q["correct"]} == {bank.choices[i] for i in bank.correct}
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
    seed, entry = first_of_kind(tmp_path, True, "--topic", "launch")
    answers = tmp_path / "answers.txt"
    answers.write_text("# my answers\nb, c  # several letters\n\na\nd  # last\n", encoding="utf-8")
    run = quiz_json("-n", "3", "--seed", seed, "--topic", "launch", "--answers", f"@{answers}")
    assert [q["given"] for q in run["questions"]] == ["bc", "a", "d"]
    assert run["questions"][0]["id"] == entry["id"]


def test_answers_without_at_are_letters_even_when_a_file_has_that_name(state_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").write_text("b\n", encoding="utf-8")
    run = quiz_json("-n", "1", "--seed", "1", "--answers", "a")
    assert run["questions"][0]["given"] == "a"
    # A path is not read either: it is refused as letters, naming the first one that is not a choice.
    answers = tmp_path / "answers.txt"
    answers.write_text("a\n", encoding="utf-8")
    assert_clean_failure(quiz("-n", "1", "--seed", "1", "--answers", str(answers)), "is not a choice")


def test_topic_and_difficulty_filters(state_dir):
    run = quiz_json("-n", "4", "--seed", "1", "--topic", "sampler", "--topic", "core,launch",
                    "--difficulty", "hard", "--answers", "a a a a")
    assert {q["topic"] for q in run["questions"]} <= {"sampler", "core", "launch"}
    assert {q["difficulty"] for q in run["questions"]} == {"hard"}


def test_count_larger_than_the_pool_asks_every_matching_question_and_says_how_many(state_dir):
    pool = [q for q in BANK_BY_ID.values() if q.topic == "checkpoint"]
    result = quiz("-n", "50", "--topic", "checkpoint", "--answers", " ".join("a" * len(pool)), "--format", "json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["questions"]) == len(pool)
    assert f"Only {len(pool)} questions match the filters (-n 50); asking {len(pool)} questions." in result.stderr
    text = quiz("-n", "50", "--topic", "checkpoint", "--answers", " ".join("a" * len(pool)))
    assert f"Only {len(pool)} questions match the filters" in text.stdout


def test_too_few_answers_for_a_smaller_pool_names_the_pool(state_dir):
    pool = [q for q in BANK_BY_ID.values() if q.topic == "checkpoint"]
    result = quiz("-n", "50", "--topic", "checkpoint", "--answers", "a")
    assert_clean_failure(result, f"too few answers: got 1 for {len(pool)} questions")
    assert f"Only {len(pool)} questions match" in result.output


def test_one_question_is_singular(state_dir):
    assert_clean_failure(quiz("-n", "1", "--seed", "1", "--answers", "a,b"), "too many answers: got 2 for 1 question")
    result = quiz("-n", "3", "--seed", "1", input="a\n")
    assert "Interrupted after 1 of 3 questions" in result.output


# --- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "args, message",
    [
        (["--topic", "gossip"], "unknown topic 'gossip'; valid topics: " + ", ".join(TOPICS)),
        (["--topic", "core,nope"], "unknown topic 'nope'"),
        (["--topic", ""], "--topic '' names no topic; valid topics: " + ", ".join(TOPICS)),
        (["--topic", ","], "--topic ',' names no topic"),
        (["--topic", "core", "--topic", " , "], "--topic ' , ' names no topic"),
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


def test_interactive_multi_letter_answer(state_dir, tmp_path):
    seed, _ = first_of_kind(tmp_path, True)
    result = quiz("-n", "1", "--seed", seed, "--format", "json", input="a,c\n")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["questions"][0]["given"] == "ac"


def test_single_answer_question_refuses_several_letters_and_asks_again(state_dir, tmp_path):
    seed, entry = first_of_kind(tmp_path, False)
    result = quiz("-n", "1", "--seed", seed, input="a,c\nb\n")
    assert result.exit_code == 0, result.output
    assert "this question takes one letter, not 2 (ac); try again." in result.output
    assert result.output.count("Your answer: ") == 2
    assert saved_state(state_dir)["questions"][entry["id"]]["given"] == "b"


def test_single_answer_question_refuses_several_scripted_letters(state_dir, tmp_path):
    seed, _ = first_of_kind(tmp_path, False)
    result = quiz("-n", "1", "--seed", seed, "--answers", "ab")
    assert_clean_failure(result, "answer 1 ('ab'): this question takes one letter, not 2 (ab)")
    assert not (state_dir / "quiz.json").exists()


def test_piped_answers_are_echoed_after_the_prompt(state_dir):
    result = quiz("-n", "2", "--seed", "1", input="b\nc\n")
    assert result.exit_code == 0, result.output
    assert "Your answer: b\n" in result.output and "Your answer: c\n" in result.output


def test_the_id_is_shown_only_after_answering(state_dir, tmp_path):
    entry = probe_quiz(tmp_path, "-n", "1", "--seed", "5")[0]
    result = quiz("-n", "1", "--seed", "5", input="a\n")
    assert result.exit_code == 0, result.output
    before, after = result.output.split("Your answer: ", 1)
    assert "Question 1/1" in before and entry["id"] not in before
    assert f"Question id: {entry['id']}" in after


def test_wrapping_keeps_hyphenated_words_and_long_names_whole():
    from grader.quiz.render import WIDTH, paragraphs
    # "reduce-scatter" straddles the width: textwrap's default would leave "reduce-" at a line end.
    text = "x" * 70 + " reduce-scatter then all-gather with find_unused_parameters=True and "
    text += "torch.nn.parallel.DistributedDataParallel.register_comm_hook " * 2
    lines = paragraphs(text).splitlines()
    words = set(text.split())
    assert all(token in words for line in lines for token in line.split())
    assert len(lines) > 2 and all(len(line) <= WIDTH or len(line.split()) == 1 for line in lines)


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


def test_review_with_nothing_wrong_prints_json(state_dir):
    result = quiz("--review", "--seed", "3", "--format", "json")
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)
    assert run["schema"] == "ddp-grade.quiz/1" and run["seed"] == 3 and run["completed"] is True
    assert run["questions"] == [] and run["summary"]["planned"] == run["summary"]["answered"] == 0
    assert "Nothing to review" in result.stderr


def test_list_topics(state_dir):
    result = quiz("--list-topics")
    assert result.exit_code == 0
    counts = topic_counts(list(BANK_BY_ID.values()))
    lines = result.output.strip().splitlines()
    assert len(lines) == len(TOPICS) + 1
    for line, topic in zip(lines, TOPICS):
        name, count = line.split()[:2]
        assert name == topic and int(count) == counts.get(topic, 0)
    assert lines[-1] == f"{len(BANK_BY_ID)} questions in {len(TOPICS)} topics"


def test_list_topics_as_json(state_dir):
    result = quiz("--list-topics", "--format", "json")
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    counts = topic_counts(list(BANK_BY_ID.values()))
    assert listing["schema"] == "ddp-grade.quiz-topics/1"
    assert [t["topic"] for t in listing["topics"]] == list(TOPICS)
    assert all(t["questions"] == counts.get(t["topic"], 0) and t["title"] == TOPICS[t["topic"]]
               for t in listing["topics"])
    assert listing["total"] == len(BANK_BY_ID)


def test_help_mentions_the_options():
    result = CliRunner().invoke(main, ["quiz", "--help"])
    assert result.exit_code == 0
    for option in ("--topic", "--count", "--difficulty", "--seed", "--answers", "--format", "--review",
                   "--list-topics"):
        assert option in result.output
