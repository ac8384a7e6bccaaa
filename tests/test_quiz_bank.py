"""The question bank, its validator (shown able to fail), and the pure quiz logic (Hypothesis)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grader.quiz.bank import (
    BANK_DIR,
    LETTERS,
    MIN_PER_TOPIC,
    MIN_TOTAL,
    TOPICS,
    BankError,
    load_bank,
    parse_bank_file,
    topic_counts,
    validate_bank,
)
from grader.quiz.session import (
    Answer,
    AnswerError,
    order_questions,
    parse_answer,
    record_answer,
    review_questions,
    score,
    shuffle_choices,
    split_answer_lines,
    split_inline_answers,
)

BANK = load_bank()

GOOD_QUESTION = '''
[[question]]
id = "{id}"
difficulty = "{difficulty}"
question = "{question}"
choices = {choices}
answer = {answer}
explanation = "A long enough explanation of why the right answer is right and why the tempting wrong ones are wrong."
{source}
'''


def write_bank(tmp_path: Path, **overrides) -> Path:
    """A one-topic bank of two questions; ``overrides`` change the second question."""
    first = dict(id="core-a-01", difficulty="easy", question="Which one?", choices='["x", "y", "z"]',
                 answer='"a"', source='source = "torch/nn/parallel/distributed.py"')
    second = {**first, "id": "core-b-02", **overrides}
    (tmp_path / "core.toml").write_text('topic = "core"\n' + GOOD_QUESTION.format(**first)
                                        + GOOD_QUESTION.format(**second), encoding="utf-8")
    return tmp_path


def small_bank_problems(tmp_path: Path, **overrides) -> list[str]:
    return validate_bank(load_bank(write_bank(tmp_path, **overrides)), min_per_topic=0, min_total=1)


# --- the packaged bank ---------------------------------------------------------------------------

def test_packaged_bank_passes_the_validator():
    assert validate_bank(BANK) == []


def test_packaged_bank_is_large_enough_and_covers_every_topic():
    counts = topic_counts(BANK)
    assert len(BANK) >= MIN_TOTAL >= 80
    assert len(TOPICS) >= 9
    assert set(counts) == set(TOPICS)
    assert all(counts[t] >= MIN_PER_TOPIC >= 8 for t in TOPICS)


def test_packaged_bank_has_single_and_multi_select_questions_and_all_difficulties():
    assert any(q.multi for q in BANK) and any(not q.multi for q in BANK)
    assert {q.difficulty for q in BANK} == {"easy", "medium", "hard"}


def test_each_bank_file_is_named_after_its_topic():
    for path in BANK_DIR.glob("*.toml"):
        assert path.stem in TOPICS
        assert {q.topic for q in parse_bank_file(path)} == {path.stem}


def test_quiz_package_does_not_import_torch():
    for path in Path(BANK_DIR).parent.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = node.module if isinstance(node, ast.ImportFrom) else ""
            assert not any(n.split(".")[0] == "torch" for n in names + [module or ""]), path


# --- the validator can fail ----------------------------------------------------------------------

def test_validator_accepts_a_sound_small_bank(tmp_path):
    assert small_bank_problems(tmp_path) == []


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"id": "core-a-01"}, "duplicate id 'core-a-01'"),
        ({"answer": '"d"'}, "answer 'd' is not among the choices"),
        ({"choices": '["x", "y", "x"]'}, "duplicate choice"),
        ({"source": ""}, "missing source"),
        ({"source": 'source = "see the docs"'}, "missing source"),
        ({"choices": '["x", "y"]'}, "2 choices"),
        ({"choices": '["a", "b", "c", "d", "e", "f"]'}, "6 choices"),
        ({"difficulty": "brutal"}, "unknown difficulty 'brutal'"),
        ({"answer": '["a", "b"]'}, "choose all that apply"),
        ({"answer": "[]", "question": "Pick (choose all that apply)"}, "no correct answer"),
    ],
)
def test_validator_rejects_broken_banks(tmp_path, overrides, expected):
    problems = small_bank_problems(tmp_path, **overrides)
    assert any(expected in p for p in problems), problems


def test_validator_rejects_unknown_topics_and_small_banks(tmp_path):
    (tmp_path / "gossip.toml").write_text('topic = "gossip"\n' + GOOD_QUESTION.format(
        id="gossip-01", difficulty="easy", question="Q?", choices='["x", "y", "z"]', answer='"a"',
        source='source = "torch/x.py/long"'), encoding="utf-8")
    problems = validate_bank(load_bank(tmp_path))
    assert any("unknown topic 'gossip'" in p for p in problems)
    assert any("questions in all" in p for p in problems)
    assert any("topic 'core' has 0 questions" in p for p in problems)


def test_unparsable_bank_file_raises_bank_error(tmp_path):
    (tmp_path / "core.toml").write_text("[[question]\nid = ", encoding="utf-8")
    with pytest.raises(BankError):
        load_bank(tmp_path)


# --- answers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("token, expected", [("b", {1}), ("AC", {0, 2}), ("a,c", {0, 2}), (" c a ", {0, 2})])
def test_parse_answer_accepts_letters_in_any_spelling(token, expected):
    assert parse_answer(token, 4) == frozenset(expected)


@pytest.mark.parametrize("token, letter", [("e", "e"), ("a1", "1"), ("z", "z")])
def test_parse_answer_rejects_letters_that_are_not_choices(token, letter):
    with pytest.raises(AnswerError) as info:
        parse_answer(token, 4)
    assert info.value.letter == letter


def test_answer_splitting_inline_and_file():
    assert split_inline_answers("a,bd c ,  e") == ["a", "bd", "c", "e"]
    assert split_answer_lines("a\n\n# comment\nb d  # multi\n c,e\n") == ["a", "b d", "c,e"]


# --- properties ------------------------------------------------------------------------------------

questions = st.sampled_from(BANK)
seeds = st.integers(min_value=0, max_value=2**31)


@given(questions, seeds)
def test_shuffling_keeps_the_right_answer_right(question, seed):
    presented = shuffle_choices(question, seed)
    assert sorted(presented.order) == list(range(len(question.choices)))
    # Map the displayed correct letters back through the permutation: same choices as in the bank.
    assert {presented.order[pos] for pos in presented.correct} == set(question.correct)
    assert {presented.choices[pos] for pos in presented.correct} == {question.choices[i] for i in question.correct}
    assert Answer(presented, presented.correct).right


@given(questions, seeds)
def test_shuffling_is_reproducible_for_a_seed(question, seed):
    assert shuffle_choices(question, seed) == shuffle_choices(question, seed)


@st.composite
def answered(draw):
    presented = shuffle_choices(draw(questions), draw(seeds))
    n = len(presented.choices)
    given_ = draw(st.one_of(st.just(presented.correct),
                            st.frozensets(st.integers(0, n - 1), min_size=1, max_size=n)))
    return Answer(presented, given_)


@settings(max_examples=200)
@given(st.lists(answered(), max_size=30))
def test_score_counts_exactly_the_right_answers(answers):
    result = score(answers)
    assert 0 <= result.right <= result.total == len(answers)
    assert result.right == sum(1 for a in answers if a.given == a.presented.correct)
    assert sum(r for r, _ in result.per_topic.values()) == result.right
    assert sum(n for _, n in result.per_topic.values()) == result.total
    assert all(0 <= r <= n for r, n in result.per_topic.values())


# --- ordering with history -------------------------------------------------------------------------

def test_previously_wrong_come_first_most_recent_first_then_unseen():
    pool = [q for q in BANK if q.topic == "sampler"]
    progress: dict = {}
    first, second, third = pool[0], pool[1], pool[2]
    for q, right in [(first, False), (second, True), (third, False)]:
        p = shuffle_choices(q, 0)
        given_ = p.correct if right else frozenset(range(len(p.choices))) - p.correct
        progress = record_answer(progress, Answer(p, given_))
    ordered = order_questions(pool, progress, seed=5)
    assert [q.id for q in ordered[:2]] == [third.id, first.id]
    assert second.id not in [q.id for q in ordered[2:len(pool) - 1]]  # seen-and-right goes last
    assert ordered[-1].id == second.id
    assert [q.id for q in review_questions(pool, progress)] == [third.id, first.id]


def test_letters_cover_the_largest_question():
    assert max(len(q.choices) for q in BANK) <= len(LETTERS)
