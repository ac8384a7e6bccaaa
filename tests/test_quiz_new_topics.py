"""The quiz topics on current practice (mixed precision, compile, NCCL, comm hooks, DCP, FSDP,
elastic launch, memory) and on capacity planning: what the bank's validator does not check on its own.

The validator (tests/test_quiz_bank.py runs it on the packaged bank) checks each question, its
sources and demos, and the giveaway figures of the whole bank. Here: each of these topics has
the size its brief asks for, was checked against the torch these demos run on, demonstrates most
of its claims, and meets the giveaway limits on its own rather than only inside the whole bank
(the longest choice over these topics together; qualifying clauses and reasons on each topic).
"""

from __future__ import annotations

import pytest

from grader.quiz.bank import (
    TOPICS,
    load_bank,
)
from grader.quiz.giveaways import (
    MAX_QUALIFIER_SCORE,
    absolute_words,
    longest_choice_score,
    multi_answer_counts,
    qualifier_score,
    reason_elimination_score,
)

NEW_TOPICS = ("mixed-precision", "compile", "nccl", "comm-hooks", "dcp", "fsdp", "elastic", "memory", "capacity")
MIN_QUESTIONS = {"mixed-precision": 8, "compile": 6, "nccl": 8, "comm-hooks": 6, "dcp": 6, "fsdp": 8,
                 "elastic": 8, "memory": 6, "capacity": 12}
CHECKED = "2.13.0"

QUESTIONS = [q for q in load_bank() if q.topic in NEW_TOPICS]


def test_topics_are_registered_and_large_enough():
    counts = {topic: sum(1 for q in QUESTIONS if q.topic == topic) for topic in NEW_TOPICS}
    assert all(topic in TOPICS for topic in NEW_TOPICS)
    assert all(counts[t] >= MIN_QUESTIONS[t] for t in NEW_TOPICS), counts
    assert len(QUESTIONS) >= 70


def test_every_question_was_checked_against_the_torch_of_the_demos():
    assert {q.id: q.checked for q in QUESTIONS if q.checked != CHECKED} == {}


def test_enough_claims_are_demonstrated():
    demonstrated = sum(1 for q in QUESTIONS if q.demos)
    demo_tests = {d for q in QUESTIONS for d in q.demos}
    assert demonstrated >= 45 and len(demo_tests) >= 30, (demonstrated, len(demo_tests))


def test_longest_choice_scores_at_most_30_percent_on_these_topics():
    score = longest_choice_score(QUESTIONS)
    assert score <= 0.30, f"picking the longest choice scores {score:.0%} on these topics"


@pytest.mark.parametrize("topic", NEW_TOPICS)
def test_clauses_give_nothing_away_on_each_topic(topic):
    own = [q for q in QUESTIONS if q.topic == topic]
    most, fewest, reasons = qualifier_score(own), qualifier_score(own, fewest=True), reason_elimination_score(own)
    assert most <= MAX_QUALIFIER_SCORE, f"picking the most qualified choice scores {most:.0%} on {topic}"
    assert fewest <= MAX_QUALIFIER_SCORE, f"picking the least qualified choice scores {fewest:.0%} on {topic}"
    assert reasons <= MAX_QUALIFIER_SCORE, f"striking out choices that give a reason scores {reasons:.0%} on {topic}"


def test_choose_all_questions_vary_their_number_of_right_answers():
    assert {"1", "2", "3", "all"} <= set(multi_answer_counts(QUESTIONS))


def absolute_word_tells(question) -> list[str]:
    """Wrong choices of ``question`` that use an absolute word none of its right choices uses."""
    right_words = set().union(*(absolute_words(question.choices[i]) for i in question.correct))
    return [c for i, c in enumerate(question.choices) if i not in question.correct and absolute_words(c) - right_words]


@pytest.mark.parametrize("question", QUESTIONS, ids=[q.id for q in QUESTIONS])
def test_absolute_words_are_no_tell_within_a_question(question):
    assert absolute_word_tells(question) == []


def test_absolute_word_tell_is_found():
    from grader.quiz.question import Question

    def question(choices):
        return Question(id="x", topic="core", difficulty="easy", text="?", choices=tuple(choices),
                        answer_letters=("a",), multi=False, explanation="", sources=())

    assert absolute_word_tells(question(["It waits", "It always waits", "It stops"])) == ["It always waits"]
    assert absolute_word_tells(question(["It always waits", "It never waits", "It stops"])) == ["It never waits"]
    assert absolute_word_tells(question(["It always waits", "It always stops", "an all-reduce"])) == []
