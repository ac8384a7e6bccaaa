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
    MIN_TOPICS,
    MIN_TOTAL,
    TOPICS,
    BankError,
    bank_figures,
    count_problems,
    leaning_phrases,
    load_bank,
    parse_bank_file,
    topic_counts,
    topic_figures,
    validate_bank,
)
from grader.quiz.giveaways import (
    CLOSEST_MARGIN,
    FARTHEST_MARGIN,
    MAX_LONGEST_SCORE,
    MAX_QUALIFIER_SCORE,
    MAX_REASON_ELIMINATION_SCORE,
    RECURRING_MARGIN,
    TOPIC_CLOSEST_MARGIN,
    absolute_words,
    chance_score,
    closeness,
    closest_choice_keys,
    closest_choice_score,
    elimination_score,
    gives_reason,
    longest_choice_keys,
    longest_choice_score,
    qualifier_score,
    qualifying_marks,
    reason_elimination_score,
    recurring_choice_score,
    recurring_words,
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
ROOT = Path(__file__).resolve().parent.parent

GOOD_SOURCE = 'source = "torch/nn/parallel/distributed.py::DistributedDataParallel.no_sync"'
GOOD_DEMO = 'demo = "tests/quiz_demos/test_accumulation.py::test_the_forward_must_run_inside_no_sync"'
GOOD_QUESTION = """
[[question]]
id = "{id}"
difficulty = "{difficulty}"
question = "{question}"
choices = {choices}
answer = {answer}
explanation = "{explanation}"
{source}
{demo}
{checked}
"""
GOOD = dict(id="core-a-01", difficulty="easy", question="Which one?", choices='["xx", "yy", "zz"]', answer='"a"',
            explanation="A long enough explanation of why the right answer is right and why the tempting wrong ones are "
                        "wrong.",
            source=GOOD_SOURCE, demo=GOOD_DEMO, checked='checked = "2.13.0"')


def entry(**overrides) -> str:
    return GOOD_QUESTION.format(**{**GOOD, **overrides})


def write_bank(tmp_path: Path, entries: list[str], topic: str = "core") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / f"{topic}.toml").write_text(f'topic = "{topic}"\n' + "".join(entries), encoding="utf-8")
    return tmp_path


def small_bank_problems(tmp_path: Path, **overrides) -> list[str]:
    """The problems of a two-question bank whose second question has ``overrides``."""
    bank = write_bank(tmp_path, [entry(), entry(**{"id": "core-b-02", "question": "Another one?", **overrides})])
    return validate_bank(load_bank(bank))


def bank_of(tmp_path: Path, questions: list[dict]) -> list[str]:
    entries = [entry(**{"id": f"core-q-{i:02d}", **q,
                        "question": f"Question number {i} about topic {i * 7919}? " + q.get("question", "")})
               for i, q in enumerate(questions)]
    return validate_bank(load_bank(write_bank(tmp_path, entries)))


# --- the packaged bank ---------------------------------------------------------------------------

def test_packaged_bank_passes_the_validator():
    assert validate_bank(BANK) == []


def test_bank_has_150_questions_in_14_topics():
    assert count_problems(BANK) == []
    assert len(BANK) >= MIN_TOTAL >= 150 and len(TOPICS) >= MIN_TOPICS >= 14
    assert set(topic_counts(BANK)) == set(TOPICS)


def test_packaged_bank_giveaway_figures():
    figures = bank_figures(BANK)
    assert 0.15 <= figures["longest_choice_score"] <= MAX_LONGEST_SCORE
    assert figures["qualifier_score"] <= MAX_QUALIFIER_SCORE
    assert figures["fewest_qualifier_score"] <= MAX_QUALIFIER_SCORE
    assert figures["reason_elimination_score"] <= MAX_REASON_ELIMINATION_SCORE
    assert figures["elimination_score"] <= 0.35
    assert figures["chance_score"] == 0.25  # every single-answer question has four choices
    assert figures["closest_choice_score"] <= 0.25 + CLOSEST_MARGIN == 0.27
    assert figures["farthest_choice_score"] <= 0.25 + FARTHEST_MARGIN
    assert figures["recurring_choice_score"] <= 0.25 + RECURRING_MARGIN
    assert {"1", "all"} <= set(figures["multi_answer_counts"])
    assert figures["with_demo"] >= 35


def test_packaged_bank_has_single_and_multi_select_questions_and_all_difficulties():
    assert any(q.multi for q in BANK) and any(not q.multi for q in BANK)
    assert {q.difficulty for q in BANK} == {"easy", "medium", "hard"}


def test_every_question_says_which_torch_it_was_checked_against():
    assert all(q.checked for q in BANK)


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


def test_right_answer_positions_are_spread_evenly_after_shuffling():
    counts = [0, 0, 0, 0]
    four = [q for q in BANK if not q.multi and len(q.choices) == 4]
    for q in four:
        for seed in range(100):
            counts[next(iter(shuffle_choices(q, seed).correct))] += 1
    total = sum(counts)
    assert all(abs(c / total - 0.25) < 0.02 for c in counts), counts


# --- the validator can fail ----------------------------------------------------------------------

def test_validator_accepts_a_sound_small_bank(tmp_path):
    assert small_bank_problems(tmp_path) == []


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"id": "core-a-01"}, "duplicate id 'core-a-01'"),
        ({"answer": '"d"'}, "answer 'd' is not among the choices"),
        ({"choices": '["x", "y", "x"]'}, "duplicate choice"),
        ({"choices": '["x", "y"]'}, "2 choices"),
        ({"choices": '["a", "b", "c", "d", "e", "f"]'}, "6 choices"),
        ({"difficulty": "brutal"}, "unknown difficulty 'brutal'"),
        ({"answer": '["a", "b"]'}, "choose all that apply"),
        ({"answer": "[]", "question": "Pick (choose all that apply)"}, "no correct answer"),
        ({"explanation": "Too short."}, "too short explanation"),
        # sources: present, precise, and pointing at something that exists
        ({"source": ""}, "missing source"),
        ({"source": 'source = "see the docs"'}, "is not a docs URL with #anchor, torch/<file>.py::Name or docs/<name>.md#section"),
        ({"source": 'source = "torch/nn/parallel/distributed.py"'}, "is not a docs URL"),
        ({"source": 'source = "https://docs.pytorch.org/docs/stable/distributed.html"'}, "has no #anchor"),
        ({"source": 'source = "https://example.com/page#section"'}, "host 'example.com' is not one of"),
        ({"source": 'source = "torch/nn/parallel/not_there.py::DistributedDataParallel"'},
         "does not exist in the installed torch"),
        ({"source": 'source = "torch/nn/parallel/distributed.py::NoSuchClass"'}, "defines no 'NoSuchClass'"),
        ({"source": 'source = "torch/nn/parallel/distributed.py::DistributedDataParallel.no_such_method"'},
         "defines no 'DistributedDataParallel.no_such_method'"),
        ({"source": 'source = "torch/nn/parallel/distributed.py::DistributedDataParallel#L10-L99999999"'},
         "are outside the file"),
        ({"source": 'source = ["torch/nn/parallel/distributed.py::DistributedDataParallel", "torch/x.py::Y"]'},
         "torch/x.py does not exist"),
        ({"source": 'source = "docs/no-such-doc.md#the-model"'}, "docs/no-such-doc.md does not exist"),
        ({"source": 'source = "docs/resilience.md#no-such-section"'}, "docs/resilience.md has no section #no-such-section"),
        # demos name an existing test function
        ({"demo": 'demo = "tests/other/test_x.py::test_y"'}, "is not tests/quiz_demos/test_<name>.py::test_<name>"),
        ({"demo": 'demo = "tests/quiz_demos/test_nothing_here.py::test_y"'}, "does not exist"),
        ({"demo": 'demo = "tests/quiz_demos/test_core.py::test_no_such_demo"'}, "has no function 'test_no_such_demo'"),
        # the torch version it was checked against
        ({"checked": ""}, "missing checked"),
        ({"checked": 'checked = "latest"'}, "checked 'latest' is not a version"),
        # explanations cannot point at a position: choices are shuffled on screen
        ({"explanation": "The second choice inverts the condition, which is the classic mistake made here."},
         "points at a choice by position ('second choice')"),
        ({"explanation": "Option b is what the tutorial does, but it keeps the prefix on every single key."},
         "points at a choice by position ('Option b')"),
        ({"explanation": "It is not (c) because that one keeps the prefix on every single key of the dict."},
         "points at a choice by position"),
        # the right answer much longer than every distractor
        ({"choices": '["the right answer, spelled out at great length with every detail", "short", "brief"]'},
         "is by far the longest"),
    ],
)
def test_validator_rejects_broken_questions(tmp_path, overrides, expected):
    problems = small_bank_problems(tmp_path, **overrides)
    assert any(expected in p for p in problems), problems


def test_validator_accepts_sources_with_methods_line_ranges_and_urls(tmp_path):
    for source in ('source = "torch/nn/parallel/distributed.py::DistributedDataParallel.no_sync#L1-L20"',
                   'source = "torch/utils/data/distributed.py::DistributedSampler.set_epoch"',
                   'source = "torch/distributed/constants.py::default_pg_timeout"',
                   'source = "https://docs.pytorch.org/docs/stable/notes/ddp.html#internal-design"',
                   'source = "https://ar5iv.labs.arxiv.org/html/1910.02054#S3.SS1"',  # a paper's section
                   'source = "docs/resilience.md#llama-3-405b"',  # the kit's own model, derived in its docs
                   'source = ["torch/nn/modules/utils.py::consume_prefix_in_state_dict_if_present", '
                   '"https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md#allreduce"]'):
        assert small_bank_problems(tmp_path, source=source) == [], source


def test_validator_accepts_an_explanation_that_uses_letters_as_words(tmp_path):
    text = "A rank waits for an answer a peer never sends, and the other options all fail to see that clearly."
    assert small_bank_problems(tmp_path, explanation=text) == []


def test_longest_choice_strategy_is_limited_both_ways(tmp_path):
    long_right = dict(choices='["the right one, longer", "wrong one", "wrong two"]')
    problems = bank_of(tmp_path / "a", [long_right] * 10)
    assert any("picking the longest choice scores 100%" in p for p in problems), problems
    short_right = dict(choices='["right one", "the wrong one, longer", "wrong two"]')
    problems = bank_of(tmp_path / "b", [short_right] * 20)
    assert any("picking the longest choice scores only 0%" in p for p in problems), problems
    mixed = [long_right] * 5 + [short_right] * 15
    assert not [p for p in bank_of(tmp_path / "c", mixed) if "picking the longest" in p]


def test_longest_choice_strategy_is_limited_in_each_topic(tmp_path):
    """Half of one topic keyed on its longest choice is a problem even where the whole bank, with a
    second topic that never is, stays within the ceiling."""
    long_right = dict(choices='["the right one, longer", "wrong one", "wrong two"]')
    short_right = dict(choices='["right one", "the wrong one, longer", "wrong two"]')
    core = [entry(**{**q, "id": f"core-q-{i:02d}", "question": f"Core question {i}, case {i * 7919}?"})
            for i, q in enumerate([long_right] * 4 + [short_right] * 4)]
    sampler = [entry(**{**short_right, "id": f"sampler-q-{i:02d}", "question": f"Sampler question {i}, {i * 104729}?"})
               for i in range(12)]
    write_bank(tmp_path, core, topic="core")
    write_bank(tmp_path, sampler, topic="sampler")
    questions = load_bank(tmp_path)
    assert longest_choice_score(questions) == pytest.approx(4 / 20)  # the bank as a whole: within limits
    problems = [p for p in validate_bank(questions) if "picking the longest" in p]
    assert problems == [
        "topic 'core': picking the longest choice scores 50% over its 8 single-answer questions (at most 35% in "
        "each topic); the right choice is the unique longest in 4 of them (core-q-00, core-q-01, core-q-02, "
        "core-q-03): rebalance the lengths of their choices"], problems
    # A tie among the longest counts 1/k, as over the whole bank: three-way ties in every question are fine.
    tied = [entry(id=f"core-t-{i:02d}", question=f"Tied question {i}, {i * 31}?") for i in range(8)]
    assert not [p for p in validate_bank(load_bank(write_bank(tmp_path / "tied", tied))) if "picking the longest" in p]


@pytest.mark.parametrize("topic", list(topic_figures(BANK)))
def test_no_topic_keys_its_longest_choice_above_the_ceiling(topic):
    own = [q for q in BANK if q.topic == topic]
    score = longest_choice_score(own)
    assert score <= MAX_LONGEST_SCORE, (f"picking the longest choice scores {score:.0%} on {topic}; "
                                        f"unique longest keys: {longest_choice_keys(own)}")


@pytest.mark.parametrize("topic", list(topic_figures(BANK)))
def test_no_topic_keys_its_closest_or_farthest_choice_above_the_ceiling(topic):
    own = [q for q in BANK if q.topic == topic]
    chance, closest, farthest = chance_score(own), closest_choice_score(own), closest_choice_score(own, farthest=True)
    assert closest <= chance + TOPIC_CLOSEST_MARGIN, (f"picking the closest choice scores {closest:.0%} on {topic}; "
                                                      f"unique closest keys: {closest_choice_keys(own)}")
    assert farthest <= chance + FARTHEST_MARGIN, f"picking the farthest choice scores {farthest:.0%} on {topic}"


#: A right answer each distractor was made from by changing one word: it shares two of three words with each.
CENTROID = dict(choices='["alpha beta gamma", "alpha beta delta", "alpha epsilon gamma", "zeta beta gamma"]')
#: Two slots, two values each, every pair present: each choice shares one word with two others.
GRID = dict(choices='["alpha beta", "alpha delta", "epsilon beta", "epsilon delta"]')
#: A distractor, not the right answer, shares the most with the others.
OFF_CENTRE = dict(choices='["x y w", "x q", "x y z", "v y z"]')
#: The right answer shares nothing with distractors that share a word among themselves.
ODD_ONE_OUT = dict(choices='["omega", "alpha beta", "alpha gamma", "alpha delta"]')


def test_closeness_is_the_sum_of_word_shares_with_the_other_choices():
    from fractions import Fraction
    assert closeness(["alpha beta gamma", "alpha beta delta", "alpha epsilon gamma", "zeta beta gamma"]) == [
        Fraction(3, 2), Fraction(9, 10), Fraction(9, 10), Fraction(9, 10)]  # 2/4 with each; 2/4 + 1/5 + 1/5
    assert len(set(closeness(["alpha beta", "alpha delta", "epsilon beta", "epsilon delta"]))) == 1
    # Words are whole: numbers with their decimals, names with dots and slashes, any case.
    assert closeness(["1.5 chunks", "1.875 chunks"]) == [Fraction(1, 3)] * 2
    assert closeness(["dist.all_reduce", "dist.broadcast", "n/2 rows", "N/2 rows"])[2:] == [Fraction(1)] * 2
    assert recurring_words(["a1 b1", "a1 b2", "a2 b1", "a3 b3"]) == [2, 1, 1, 0]


def test_picking_the_choice_closest_to_the_others_is_limited_over_the_bank(tmp_path):
    problems = bank_of(tmp_path / "a", [CENTROID] * 10)
    assert any("picking the choice closest to the others (the most words in common with them) scores 100%" in p
               and "where guessing scores 25% (at most 27%)" in p for p in problems), problems
    for name, shape in (("b", GRID), ("c", OFF_CENTRE)):
        assert not [p for p in bank_of(tmp_path / name, [shape] * 10) if "closest to the others" in p], name
    # Ties count 1/k: a centroid key in 1 question of 20 and a four-way tie in the rest is 28.75% (> 27%); the
    # same with an off-centre key instead of the ties is 5%.
    assert any("closest to the others" in p for p in bank_of(tmp_path / "d", [CENTROID] + [GRID] * 19))
    assert not [p for p in bank_of(tmp_path / "e", [CENTROID] + [OFF_CENTRE] * 19) if "closest to the others" in p]


def test_picking_the_choice_closest_to_the_others_is_limited_in_each_topic(tmp_path):
    """Three centroid keys in one topic's eight questions is a problem even where the whole bank, with a
    second topic that never keys its closest choice, stays within the ceiling."""
    core = [entry(**{**q, "id": f"core-q-{i:02d}", "question": f"Core question {i}, case {i * 7919}?"})
            for i, q in enumerate([CENTROID] * 3 + [GRID] * 5)]
    sampler = [entry(**{**OFF_CENTRE, "id": f"sampler-q-{i:02d}", "question": f"Sampler question {i}, {i * 104729}?"})
               for i in range(12)]
    write_bank(tmp_path, core, topic="core")
    write_bank(tmp_path, sampler, topic="sampler")
    questions = load_bank(tmp_path)
    assert closest_choice_score(questions) == pytest.approx((3 + 5 / 4) / 20)  # the bank as a whole: within limits
    problems = [p for p in validate_bank(questions) if "closest to the others" in p]
    assert problems == [
        "topic 'core': picking the choice closest to the others scores 53% over its 8 single-answer questions, where "
        "guessing scores 25% (at most 35% in each topic); the right choice is the unique closest in 3 of them "
        "(core-q-00, core-q-01, core-q-02): make their distractors differ from it in more than one part"], problems


def test_picking_the_choice_farthest_from_the_others_is_limited(tmp_path):
    problems = bank_of(tmp_path / "a", [ODD_ONE_OUT] * 10)
    assert any("picking the choice farthest from the others scores 100%" in p for p in problems), problems
    assert any("topic 'core': picking the choice farthest from the others scores 100%" in p for p in problems)
    assert not [p for p in bank_of(tmp_path / "b", [OFF_CENTRE] * 10) if "farthest" in p]


def test_picking_the_choice_with_the_most_recurring_words_is_limited(tmp_path):
    modal = dict(choices='["a1 b1", "a1 b2", "a2 b1", "a3 b3"]')  # the key holds the value repeated in each slot
    problems = bank_of(tmp_path / "a", [modal] * 10)
    assert any("picking the choice that holds the most words found in other choices scores 100%" in p
               for p in problems), problems
    assert recurring_choice_score(load_bank(tmp_path / "a")) == 1.0
    assert not [p for p in bank_of(tmp_path / "b", [GRID] * 10) if "most words found in other choices" in p]


def test_the_closest_choice_ceiling_follows_the_chance_of_guessing(tmp_path):
    """Three choices tied in every question score 1/3, the chance of guessing: no cue, whatever the bank's size."""
    tied = dict(choices='["alpha beta", "alpha gamma", "alpha delta"]')
    questions = load_bank(write_bank(tmp_path, [entry(id=f"core-t-{i:02d}", question=f"Tied {i}, {i * 31}?", **tied)
                                                for i in range(30)]))
    assert chance_score(questions) == pytest.approx(1 / 3) and closest_choice_score(questions) == pytest.approx(1 / 3)
    assert not [p for p in validate_bank(questions) if "closest" in p or "farthest" in p or "recurring" in p]


def test_absolute_words_only_in_distractors_are_refused(tmp_path):
    giveaway = dict(choices='["it waits for a peer", "it always returns at once", "it raises at once"]')
    problems = bank_of(tmp_path / "a", [giveaway])
    assert any("the absolute word 'always' appears only in wrong choices (1: core-q-00)" in p
               for p in problems), problems
    fair = dict(choices='["it always waits for a peer", "it always returns at once", "it raises at once"]')
    assert not [p for p in bank_of(tmp_path / "b", [giveaway, fair]) if "absolute" in p]


def test_striking_out_absolute_words_is_measured(tmp_path):
    telling = dict(choices='["it waits", "it never waits", "it must raise", "it returns none"]')
    problems = bank_of(tmp_path, [telling] * 3)
    assert any("striking out the choices with absolute words scores 100%" in p for p in problems), problems


def test_absolute_words_are_whole_words_not_parts_of_names():
    assert absolute_words("an all-reduce, all_gather and all-to-all") == set()
    assert absolute_words("every rank must wait; all of them") == {"every", "must", "all"}
    assert absolute_words("None: nothing happens") == {"none"} and absolute_words("returns None") == set()


@pytest.mark.parametrize("choice, marks", [
    ("it waits; then it raises", 1),
    ("Yes: the sampler pads the list", 1),
    ("3 each (the first 2 indices repeated)", 1),
    ("after 10 minutes \u2014 then it aborts", 1),
    ("It works, unless the group is gone", 1),
    ("only when the buckets are rebuilt, except the first", 2),
    ("scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()", 0),   # a line of code
    ("torch.device('cuda:0') and torch/x.py::Name", 0),                             # not prose colons
    ("f(x) of shape (6, 4), from (i + 1) % accum", 0),                              # calls, shapes, arithmetic
    ("(W - 1) / (M + W - 1), an all-reduce", 0),                                    # not dashes
])
def test_qualifying_marks_count_clauses_not_code(choice, marks):
    assert qualifying_marks(choice) == marks


def test_picking_the_most_qualified_choice_is_measured(tmp_path):
    telling = dict(choices='["it waits; then it raises", "it returns", "it raises"]')
    problems = bank_of(tmp_path / "a", [telling] * 10)
    assert any("picking the choice with the most qualifying clauses" in p and "scores 100%" in p
               for p in problems), problems
    # Clauses in distractors too: a tie in half of the questions, a qualified distractor in the others.
    tied = dict(choices='["it waits; then it raises", "it returns: at once", "it raises"]')
    misled = dict(choices='["it waits", "it returns: at once", "it raises"]')
    problems = bank_of(tmp_path / "b", [tied] * 5 + [misled] * 5)
    assert not [p for p in problems if "qualifying clauses" in p], problems


def test_picking_the_least_qualified_choice_is_measured(tmp_path):
    overcorrected = dict(choices='["it waits", "it returns: at once", "it raises; later"]')
    problems = bank_of(tmp_path, [overcorrected] * 10)
    assert any("picking the choice with the fewest qualifying clauses scores 100%" in p for p in problems), problems


def test_qualifier_figures_of_a_known_bank(tmp_path):
    questions = load_bank(write_bank(tmp_path, [
        entry(id="core-x-01", choices='["right; qualified", "wrong", "also wrong"]'),
        entry(id="core-x-02", question="Second?", choices='["right: qualified", "wrong: too", "plain"]'),
        entry(id="core-x-03", question="Third?", choices='["right", "wrong: qualified", "wrong"]'),
    ]))
    assert qualifier_score(questions) == pytest.approx((1 + 1 / 2 + 0) / 3)
    assert qualifier_score(questions, fewest=True) == pytest.approx((0 + 0 + 1 / 2) / 3)
    assert topic_figures(questions)["core"]["qualifier_score"] == pytest.approx(0.5)


def test_striking_out_choices_that_give_a_reason_is_measured(tmp_path):
    assert gives_reason("wrong, because DDP averages") and gives_reason("it waits, so the job hangs")
    assert not gives_reason("it is the same as before")
    arguing = dict(choices='["it waits", "it returns, because it can", "it raises, since it must"]')
    problems = bank_of(tmp_path / "a", [arguing] * 3)
    assert any("striking out the choices that give a reason" in p and "scores 100%" in p for p in problems), problems
    assert reason_elimination_score(load_bank(tmp_path / "a")) == 1.0
    fair = dict(choices='["it waits, because it must", "it returns, because it can", "it raises"]')
    assert not [p for p in bank_of(tmp_path / "b", [fair] * 3) if "give a reason" in p]


@pytest.mark.parametrize("text, phrase", [
    ("The same 10 samples and 4 ranks, now with drop_last=True. What does each rank get?", "The same 10 samples"),
    ("In that MLP (fc1 column-parallel, fc2 row-parallel), which tensors are all-reduced?", "that MLP"),
    ("Which changes make that model train correctly under DDP?", "that model"),
    ("As before, the model is wrapped in DDP. What happens?", "As before"),
    ("Using the setup of the previous question, how many buckets are there?", "previous question"),
    ("Can you register it on this model too?", "this model"),
])
def test_a_question_that_leans_on_another_is_refused(tmp_path, text, phrase):
    assert any(found.startswith(phrase) for found in leaning_phrases(text)), leaning_phrases(text)
    problems = small_bank_problems(tmp_path, question=text)
    assert any("leans on another question" in p and phrase in p for p in problems), problems


@pytest.mark.parametrize("text", [
    "Each of 2 ranks has a gradient entry of 40000.0. What does that entry hold after backward?",
    "A hand-written FSDP re-gathers each unit before its backward. Why can that gather be skipped?",
    "A model has a branch that forward() never uses. What happens?",
    "How should a training script be structured so that torchrun restarts it?",
    "Which of these restore every weight of the plain model?",
    "Every rank computes the same loss from the result. What happens to the gradient?",
    "With the same per-GPU batch as on 1 GPU, how does the training time change?",
    "A job hangs in its first allreduce, and the same job runs when NCCL_P2P_DISABLE=1 is set. Why?",
    "Rank 0 runs its third micro-batch outside no_sync() while rank 1 runs the same micro-batch inside it.",
    "A run reaches a loss scale of 1024. What keeps the same loss scale after a resume?",
])
def test_references_inside_one_question_are_accepted(tmp_path, text):
    assert leaning_phrases(text) == []
    assert small_bank_problems(tmp_path, question=text) == []


def test_no_packaged_question_leans_on_another():
    assert {q.id: leaning_phrases(q.text) for q in BANK if leaning_phrases(q.text)} == {}


def test_choose_all_questions_must_vary_their_number_of_right_answers(tmp_path):
    question = "Which hold? (choose all that apply)"
    two_of_four = dict(question=question, choices='["p", "q", "r", "s"]', answer='["a", "b"]')
    problems = bank_of(tmp_path / "a", [two_of_four] * 4)
    assert any("multi-select questions have 4 with 2 right answers: vary them" in p for p in problems), problems
    assert any("no one count may cover more than half" in p for p in problems), problems
    varied = [dict(two_of_four, answer=a) for a in ('["a"]', '["a", "b"]', '["a", "b", "c"]', '["a", "b", "c", "d"]')]
    assert not [p for p in bank_of(tmp_path / "b", varied) if "multi-select" in p]


def test_near_duplicates_are_refused(tmp_path):
    text = "After rank 0 saves the checkpoint, why must the other ranks wait at a barrier before loading it?"
    bank = write_bank(tmp_path, [entry(question=text), entry(id="core-b-02", question="So: " + text.lower())])
    problems = validate_bank(load_bank(bank))
    assert any("core-a-01 and core-b-02 are near-duplicates" in p for p in problems), problems


def test_count_thresholds(tmp_path):
    (tmp_path / "gossip.toml").write_text('topic = "gossip"\n' + entry(id="gossip-01"), encoding="utf-8")
    questions = load_bank(tmp_path)
    assert any("unknown topic 'gossip'" in p for p in validate_bank(questions))
    problems = count_problems(questions)
    assert any("1 questions in all (want at least 150)" in p for p in problems)
    assert any("topic 'core' has 0 questions" in p for p in problems)
    assert count_problems(questions, min_per_topic=0, min_total=1, min_topics=1) == []


def test_unparsable_bank_file_raises_bank_error(tmp_path):
    (tmp_path / "core.toml").write_text("[[question]\nid = ", encoding="utf-8")
    with pytest.raises(BankError):
        load_bank(tmp_path)


def test_figures_of_a_known_bank(tmp_path):
    questions = load_bank(write_bank(tmp_path, [
        entry(id="core-x-01", choices='["right and longest", "no", "nope"]'),
        entry(id="core-x-02", question="Second?", choices='["right", "wrong and longest", "never this"]'),
    ]))
    assert longest_choice_score(questions) == 0.5
    assert elimination_score(questions) == pytest.approx((1 / 3 + 1 / 2) / 2)


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
