"""The quiz topics on current practice (mixed precision, compile, NCCL, comm hooks, DCP, FSDP,
elastic launch, memory): each question sound, sourced where the claim is, demonstrated where it can
run, checked against the installed torch, and not answerable by its shape alone."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest
import torch

from grader.quiz.bank import BANK_DIR, TOPICS, parse_bank_file, question_problems

ROOT = Path(__file__).resolve().parent.parent
TORCH_ROOT = Path(torch.__file__).parent
NEW_TOPICS = ("mixed-precision", "compile", "nccl", "comm-hooks", "dcp", "fsdp", "elastic", "memory")
MIN_QUESTIONS = {"mixed-precision": 8, "compile": 6, "nccl": 8, "comm-hooks": 6, "dcp": 6, "fsdp": 8,
                 "elastic": 8, "memory": 6}
CHECKED = "2.13.0"
ABSOLUTE_WORDS = ("always", "never", "every", "only", "all", "any", "none", "must")
DOCS_PREFIXES = ("https://docs.pytorch.org/docs/stable/", "https://docs.nvidia.com/deeplearning/nccl/")
POSITION_WORDS = re.compile(r"\b(first|second|third|fourth|last|other)\s+(choice|option|answer)s?\b"
                            r"|\b(choice|option)\s+[a-e]\b|\([a-e]\)", re.IGNORECASE)


def _entries():
    """(topic, question, raw TOML table) for every question of the new topics."""
    rows = []
    for topic in NEW_TOPICS:
        path = BANK_DIR / f"{topic}.toml"
        raw = tomllib.loads(path.read_text(encoding="utf-8"))["question"]
        for question, table in zip(parse_bank_file(path), raw, strict=True):
            rows.append((topic, question, table))
    return rows


ENTRIES = _entries()
IDS = [q.id for _, q, _ in ENTRIES]


def _words(text):
    return {w.lower() for w in re.findall(r"[A-Za-z]+", text)}


def test_topics_are_registered_and_large_enough():
    counts = {topic: sum(1 for t, _, _ in ENTRIES if t == topic) for topic in NEW_TOPICS}
    assert all(topic in TOPICS for topic in NEW_TOPICS)
    assert all(counts[t] >= MIN_QUESTIONS[t] for t in NEW_TOPICS), counts
    assert len(ENTRIES) >= 70


@pytest.mark.parametrize("topic, question, table", ENTRIES, ids=IDS)
def test_question_is_sound(topic, question, table):
    assert question.topic == topic
    assert question_problems(question) == []
    assert table.get("checked") == CHECKED
    assert not POSITION_WORDS.search(question.explanation), "explanation refers to a choice position"


def test_ids_are_unique_across_the_whole_bank():
    everything = [q.id for path in BANK_DIR.glob("*.toml") for q in parse_bank_file(path)]
    assert len(everything) == len(set(everything))


@pytest.mark.parametrize("topic, question, table", ENTRIES, ids=IDS)
def test_source_shows_where_the_claim_is(topic, question, table):
    source = question.source
    if source.startswith("https://"):
        assert source.startswith(DOCS_PREFIXES), source
        assert "#" in source and not source.endswith("#"), f"{source}: no section anchor"
        return
    path, sep, name = source.partition("::")
    assert sep and name, f"{source}: give the function or class after '::'"
    assert path.startswith("torch/")
    file = TORCH_ROOT.parent / path.split("#")[0]
    assert file.is_file(), f"{path} is not in the installed torch"
    text = file.read_text(encoding="utf-8")
    for part in name.split("#")[0].split("."):
        assert re.search(rf"\b{re.escape(part)}\b", text), f"{part!r} does not appear in {path}"


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


@pytest.mark.parametrize("topic, question, table", [e for e in ENTRIES if "demo" in e[2]],
                         ids=[q.id for _, q, t in ENTRIES if "demo" in t])
def test_demo_names_an_existing_test(topic, question, table):
    file, sep, name = table["demo"].partition("::")
    assert sep and file.startswith("tests/quiz_demos/test_"), table["demo"]
    assert name in _test_functions(ROOT / file), f"{table['demo']} does not exist"


def test_enough_claims_are_demonstrated():
    demonstrated = sum(1 for _, _, t in ENTRIES if "demo" in t)
    demo_tests = {t["demo"] for _, _, t in ENTRIES if "demo" in t}
    assert demonstrated >= 45 and len(demo_tests) >= 30, (demonstrated, len(demo_tests))


# --- giveaways ---------------------------------------------------------------------------------

def longest_choice_share(questions) -> float:
    """Share of single-answer questions whose right choice is the longest (ties count)."""
    single = [q for q in questions if not q.multi]
    hits = 0
    for q in single:
        right = next(iter(q.correct))
        hits += len(q.choices[right]) >= max(len(c) for c in q.choices)
    return hits / len(single)


def test_longest_choice_is_right_in_at_most_30_percent():
    share = longest_choice_share([q for _, q, _ in ENTRIES])
    assert share <= 0.30, f"the longest choice is right in {share:.0%} of single-answer questions"


def test_choose_all_questions_vary_their_number_of_right_answers():
    counts = {len(q.correct) for _, q, _ in ENTRIES if q.multi}
    assert {1, 2, 3, 4} <= counts, counts


@pytest.mark.parametrize("topic, question, table", ENTRIES, ids=IDS)
def test_absolute_words_are_not_a_distractor_tell(topic, question, table):
    right_words = set().union(*(_words(question.choices[i]) for i in question.correct))
    for i, choice in enumerate(question.choices):
        if i in question.correct:
            continue
        tells = (_words(choice) & set(ABSOLUTE_WORDS)) - right_words
        assert not tells, f"distractor {choice!r} uses {sorted(tells)}, no right answer does"


def test_helpers_fail_on_giveaways():
    from grader.quiz.bank import Question

    def q(choices, answer):
        return Question(id="x", topic="core", difficulty="easy", text="?", choices=tuple(choices),
                        answer_letters=(answer,), multi=False, explanation="", source="")

    assert longest_choice_share([q(["a long right answer", "short", "tiny"], "a")]) == 1.0
    assert longest_choice_share([q(["right", "a longer wrong one", "x"], "a")]) == 0.0
    assert POSITION_WORDS.search("as the second choice says") and POSITION_WORDS.search("option b")
