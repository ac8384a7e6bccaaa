"""How much a test-wise guess scores on the bank, and the limits the bank keeps under: picking the
longest choice, the one with the most (or fewest) qualifying clauses, the one closest to the other
choices (or farthest from them), the one holding the most words that recur among the choices,
striking out choices with an absolute word or a reason; and near-duplicate questions.
:mod:`grader.quiz.bank` applies them."""

from __future__ import annotations

import re
from fractions import Fraction

from grader.quiz.question import Question

#: Giveaway limits, over the single-answer questions of the whole bank.
MAX_LONGEST_SCORE = 0.35
"""Expected score of always picking the longest choice (ties split), over the whole bank and over
each topic's own single-answer questions."""
MIN_LONGEST_SCORE = 0.15
"""... and at least this much, or "never pick the longest" becomes the giveaway."""
MAX_ELIMINATION_SCORE = 0.35
"""Expected score of picking at random among the choices without an absolute word."""
ABSOLUTE_WORDS = ("always", "never", "every", "only", "all", "any", "none", "must")
# Lower case anywhere, or capitalised at the start of a choice ("None: ..."); "None" inside a
# sentence is Python's None, and "all-reduce", "all_gather", "all-to-all" are not the word "all".
_ABSOLUTE = re.compile(r"(?<![\w-])(" + "|".join(ABSOLUTE_WORDS) + r")(?![\w-])")
_ABSOLUTE_START = re.compile(r"^(" + "|".join(w.capitalize() for w in ABSOLUTE_WORDS) + r")(?![\w-])")
MAX_QUALIFIER_SCORE = 0.35
"""Expected score of always picking the choice with the most qualifying marks, and of always
picking the one with the fewest (ties split)."""
#: What sets off an extra qualifying clause: a semicolon (not one between two calls of a line of
#: code, ``backward(); step()``), a colon that opens prose (not the one in ``cuda:0``, ``::`` or
#: ``1:4``), a parenthesis that opens an aside (not a call such as ``f(x)``, a shape such as
#: ``(6, 4)`` or arithmetic such as ``(i + 1)``), a dash between words (not ``W - 1``), and the
#: words that narrow a claim to a condition.
QUALIFYING_MARKS = re.compile(
    r"(?<!\));|\);(?!\s*[\w.]+\()"
    r"|:(?=\s|$)"
    r"|(?:^|(?<=\s))\((?![\d.]+(?:,\s*[\d.]+)*\))(?![^()]*(?:[+*/%<>]|==|\s-\s)[^()]*\))"
    r"|[\u2014\u2013]|(?<=[A-Za-z]{2})\s-\s(?=[A-Za-z]{2})"
    r"|\b(?:only (?:when|if)|unless|except|as long as|provided)\b",
    re.IGNORECASE,
)
MAX_REASON_ELIMINATION_SCORE = 0.35
"""Expected score of striking out the choices that give a reason, then guessing among the rest."""
#: A reason given inside a choice ("..., because ...", "..., so ..."): a distractor's usual disguise.
REASON_WORDS = re.compile(r"\b(?:because|since|so that|which is why)\b|,\s+so\b", re.IGNORECASE)
CLOSEST_MARGIN = 0.02
"""How far above guessing always picking the choice closest to the other choices (ties split) may
score over the whole bank: 27% where every question has four choices. Distractors made by changing
one part of the right answer each leave it the choice that shares the most with all of them."""
TOPIC_CLOSEST_MARGIN = 0.10
"""... and over each topic's own single-answer questions: 35% with four choices."""
FARTHEST_MARGIN = 0.10
"""How far above guessing always picking the choice farthest from the others may score, over the
whole bank and over each topic (35% with four choices): the giveaway of a bank that made its right
answers the odd ones out."""
RECURRING_MARGIN = 0.02
"""How far above guessing always picking the choice that holds the most recurring words may score
over the whole bank (27% with four choices)."""
#: A word of a choice, for measuring how close choices are: lower case, a number whole with its
#: decimals ("1.875"), a name whole with its dots, slashes, hyphens and apostrophes
#: ("torch.distributed", "n/2", "all-reduce", "rank's"); punctuation and spaces separate words.
CHOICE_WORD = re.compile(r"[a-z0-9_]+(?:[./'\-][a-z0-9_]+)*")
#: Two questions whose texts share this much of their words (Jaccard) are near-duplicates
#: (compared only when they have enough words between them for the share to mean something).
NEAR_DUPLICATE = 0.45
NEAR_DUPLICATE_MIN_WORDS = 8

#: Stems that point outside the question (questions are shuffled, so there is no "before").


# --- giveaways over the whole bank -------------------------------------------------------------------

def longest_choice_score(questions: list[Question]) -> float:
    """Expected score, over the single-answer questions, of always picking the longest choice
    (a tie among k longest choices counts 1/k when the right one is among them)."""
    singles = [q for q in questions if not q.multi and len(q.correct) == 1 and q.choices]
    if not singles:
        return 0.0
    total = 0.0
    for q in singles:
        lengths = [len(c) for c in q.choices]
        longest = [i for i, n in enumerate(lengths) if n == max(lengths)]
        total += (next(iter(q.correct)) in longest) / len(longest)
    return total / len(singles)


def qualifying_marks(choice: str) -> int:
    """How many qualifying clauses a choice carries: semicolons, colons that open prose, asides in
    parentheses, dashes, and "only when", "only if", "unless", "except", "as long as", "provided"."""
    return len(QUALIFYING_MARKS.findall(choice))


def qualifier_score(questions: list[Question], fewest: bool = False) -> float:
    """Expected score, over the single-answer questions, of always picking the choice with the most
    qualifying marks (with ``fewest``, the fewest: the giveaway of a bank that overcorrected); a tie
    among k such choices counts 1/k when the right one is among them."""
    singles = [q for q in questions if not q.multi and len(q.correct) == 1 and q.choices]
    if not singles:
        return 0.0
    total = 0.0
    for q in singles:
        marks = [-qualifying_marks(c) if fewest else qualifying_marks(c) for c in q.choices]
        most = [i for i, n in enumerate(marks) if n == max(marks)]
        total += (next(iter(q.correct)) in most) / len(most)
    return total / len(singles)


def choice_words(choice: str) -> frozenset[str]:
    """The distinct words of a choice (:data:`CHOICE_WORD`), in lower case."""
    return frozenset(CHOICE_WORD.findall(choice.lower()))


def closeness(choices: tuple[str, ...] | list[str]) -> list[Fraction]:
    """How close each choice is to the others: the sum, over every other choice, of the share of
    words the two have in common (Jaccard: the words in both over the words in either). A right
    answer that each distractor was made from by changing one of its parts scores highest."""
    words = [choice_words(c) for c in choices]
    return [sum((_jaccard(a, b) for j, b in enumerate(words) if j != i), Fraction(0))
            for i, a in enumerate(words)]


def _jaccard(a: frozenset[str], b: frozenset[str]) -> Fraction:
    union = a | b
    return Fraction(len(a & b), len(union)) if union else Fraction(1)


def recurring_words(choices: tuple[str, ...] | list[str]) -> list[int]:
    """How many of each choice's words recur: found in another choice too, but not in every choice.
    Where the choices fill the same slots with values ("448 from E4M3, inf from E5M2"), the choice
    that holds the most frequent value of every slot holds the most."""
    words = [choice_words(c) for c in choices]
    counts: dict[str, int] = {}
    for own in words:
        for w in own:
            counts[w] = counts.get(w, 0) + 1
    return [sum(1 for w in own if 1 < counts[w] < len(words)) for own in words]


def _pick_score(questions: list[Question], measure) -> float:
    """Expected score, over the single-answer questions, of always picking the choice that
    ``measure`` (a list of comparable figures per question's choices) puts highest; a tie among k
    such choices counts 1/k when the right one is among them."""
    singles = [q for q in questions if not q.multi and len(q.correct) == 1 and q.choices]
    if not singles:
        return 0.0
    total = 0.0
    for q in singles:
        figures = measure(q.choices)
        best = [i for i, n in enumerate(figures) if n == max(figures)]
        total += (next(iter(q.correct)) in best) / len(best)
    return total / len(singles)


def closest_choice_score(questions: list[Question], farthest: bool = False) -> float:
    """Expected score, over the single-answer questions, of always picking the choice closest to
    the others (:func:`closeness`; with ``farthest``, the one farthest from them), ties split."""
    if farthest:
        return _pick_score(questions, lambda choices: [-n for n in closeness(choices)])
    return _pick_score(questions, closeness)


def recurring_choice_score(questions: list[Question]) -> float:
    """Expected score, over the single-answer questions, of always picking the choice that holds
    the most recurring words (:func:`recurring_words`), ties split."""
    return _pick_score(questions, recurring_words)


def chance_score(questions: list[Question]) -> float:
    """Expected score of guessing, over the single-answer questions: the mean of 1 / choices."""
    singles = [q for q in questions if not q.multi and len(q.correct) == 1 and q.choices]
    return sum(1 / len(q.choices) for q in singles) / len(singles) if singles else 0.0


def closest_choice_keys(questions: list[Question]) -> list[str]:
    """Ids of the single-answer questions whose right choice is the unique closest to the others."""
    found = []
    for q in questions:
        if q.multi or len(q.correct) != 1 or not q.choices:
            continue
        figures = closeness(q.choices)
        if [i for i, n in enumerate(figures) if n == max(figures)] == [next(iter(q.correct))]:
            found.append(q.id)
    return found


def gives_reason(choice: str) -> bool:
    """Whether a choice argues for itself: "because", "since", "so that", "which is why", ", so"."""
    return bool(REASON_WORDS.search(choice))


def reason_elimination_score(questions: list[Question]) -> float:
    """Expected score, over the single-answer questions, of striking out every choice that gives a
    reason and guessing among the rest (among all, when every choice gives one)."""
    singles = [q for q in questions if not q.multi and len(q.correct) == 1 and q.choices]
    if not singles:
        return 0.0
    total = 0.0
    for q in singles:
        plain = [i for i, c in enumerate(q.choices) if not gives_reason(c)] or list(range(len(q.choices)))
        total += (next(iter(q.correct)) in plain) / len(plain)
    return total / len(singles)


def singles_count(questions: list[Question]) -> int:
    """The number of single-answer questions."""
    return sum(1 for q in questions if not q.multi)


def absolute_words(choice: str) -> set[str]:
    """The absolute words (always, never, every, only, all, any, none, must) a choice uses."""
    found = {m.group(1) for m in _ABSOLUTE.finditer(choice)}
    start = _ABSOLUTE_START.match(choice)
    if start:
        found.add(start.group(1).lower())
    return found


def elimination_score(questions: list[Question]) -> float:
    """Expected score, over the single-answer questions, of striking out every choice with an
    absolute word and guessing among the rest (among all, when every choice has one)."""
    singles = [q for q in questions if not q.multi and len(q.correct) == 1 and q.choices]
    if not singles:
        return 0.0
    total = 0.0
    for q in singles:
        plain = [i for i, c in enumerate(q.choices) if not absolute_words(c)] or list(range(len(q.choices)))
        total += (next(iter(q.correct)) in plain) / len(plain)
    return total / len(singles)


def multi_answer_counts(questions: list[Question]) -> dict[str, int]:
    """How many multi-select questions have 1, 2, ... right answers, and how many have all right."""
    counts: dict[str, int] = {}
    for q in questions:
        if q.multi and q.correct:
            key = "all" if len(q.correct) == len(q.choices) else str(len(q.correct))
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def giveaway_problems(questions: list[Question]) -> list[str]:
    """Ways to score without knowing the answers, measured over the whole bank."""
    problems = []
    longest = longest_choice_score(questions)
    if longest > MAX_LONGEST_SCORE:
        problems.append(f"picking the longest choice scores {longest:.0%} over the single-answer questions "
                        f"(at most {MAX_LONGEST_SCORE:.0%}): rebalance the lengths of the choices")
    if singles_count(questions) >= 20 and longest < MIN_LONGEST_SCORE:
        problems.append(f"picking the longest choice scores only {longest:.0%} (at least {MIN_LONGEST_SCORE:.0%}): "
                        "the right answer is so rarely the longest that avoiding the longest choice pays")
    qualified = qualifier_score(questions)
    if qualified > MAX_QUALIFIER_SCORE:
        problems.append(f"picking the choice with the most qualifying clauses (;, :, an aside in parentheses, a dash, "
                        f"'only when', 'unless', ...) scores {qualified:.0%} over the single-answer questions "
                        f"(at most {MAX_QUALIFIER_SCORE:.0%}): drop the extra clause from right choices, "
                        "or qualify the distractors as much")
    plainest = qualifier_score(questions, fewest=True)
    if plainest > MAX_QUALIFIER_SCORE:
        problems.append(f"picking the choice with the fewest qualifying clauses scores {plainest:.0%} "
                        f"(at most {MAX_QUALIFIER_SCORE:.0%}): the right choices became the plain ones, "
                        "qualify some of them again")
    chance = chance_score(questions)
    closest = closest_choice_score(questions)
    if closest > chance + CLOSEST_MARGIN + 1e-9:
        problems.append(f"picking the choice closest to the others (the most words in common with them) scores "
                        f"{closest:.0%} over the single-answer questions, where guessing scores {chance:.0%} (at most "
                        f"{chance + CLOSEST_MARGIN:.0%}): write distractors that differ from the right answer in more "
                        "than one part, or that share more with each other than with it")
    farthest = closest_choice_score(questions, farthest=True)
    if farthest > chance + FARTHEST_MARGIN + 1e-9:
        problems.append(f"picking the choice farthest from the others scores {farthest:.0%}, where guessing scores "
                        f"{chance:.0%} (at most {chance + FARTHEST_MARGIN:.0%}): the right choices became the odd "
                        "ones out, word them like their distractors again")
    recurring = recurring_choice_score(questions)
    if recurring > chance + RECURRING_MARGIN + 1e-9:
        problems.append(f"picking the choice that holds the most words found in other choices scores {recurring:.0%}, "
                        f"where guessing scores {chance:.0%} (at most {chance + RECURRING_MARGIN:.0%}): the right "
                        "choices hold the values the distractors repeat, vary the distractors' values")
    reasoned = reason_elimination_score(questions)
    if reasoned > MAX_REASON_ELIMINATION_SCORE:
        problems.append(f"striking out the choices that give a reason ('because', 'since', 'so that', ...) scores "
                        f"{reasoned:.0%} (at most {MAX_REASON_ELIMINATION_SCORE:.0%}): give reasons in right "
                        "choices too, or in none")
    eliminated = elimination_score(questions)
    if eliminated > MAX_ELIMINATION_SCORE:
        problems.append(f"striking out the choices with absolute words scores {eliminated:.0%} "
                        f"(at most {MAX_ELIMINATION_SCORE:.0%}): use such words in right answers too, or not at all")
    right_words: set[str] = set()
    wrong_words: dict[str, list[str]] = {}
    for q in questions:
        for i, choice in enumerate(q.choices):
            words = absolute_words(choice)
            if i in q.correct:
                right_words |= words
            else:
                for w in words:
                    wrong_words.setdefault(w, []).append(q.id)
    for word in sorted(set(wrong_words) - right_words):
        ids = wrong_words[word]
        problems.append(f"the absolute word {word!r} appears only in wrong choices ({len(ids)}: "
                        f"{', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''})")
    counts = multi_answer_counts(questions)
    n_multi = sum(counts.values())
    if n_multi >= 4:
        if "1" not in counts or "all" not in counts or len(counts) < 3:
            problems.append(f"multi-select questions have {_counts_text(counts)} right answers: "
                            "vary them, with some having one right answer and some having all right")
        top = max(counts.values())
        if top > n_multi / 2:
            problems.append(f"multi-select questions have {_counts_text(counts)} right answers: "
                            "no one count may cover more than half of them")
    return problems


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} with {k}" for k, n in counts.items())


def longest_choice_keys(questions: list[Question]) -> list[str]:
    """Ids of the single-answer questions whose right choice is the unique longest."""
    found = []
    for q in questions:
        if q.multi or len(q.correct) != 1 or not q.choices:
            continue
        lengths = [len(c) for c in q.choices]
        longest = [i for i, n in enumerate(lengths) if n == max(lengths)]
        if longest == [next(iter(q.correct))]:
            found.append(q.id)
    return found


def topic_giveaway_problems(questions: list[Question]) -> list[str]:
    """The longest-choice strategy, and picking the choice closest to the others or farthest from
    them, measured on each topic's own single-answer questions: a learner who drills one topic meets
    that topic's cue, however well the other topics hide theirs."""
    topics: dict[str, list[Question]] = {}
    for q in questions:
        topics.setdefault(q.topic, []).append(q)
    problems = []
    for topic, own in topics.items():
        score = longest_choice_score(own)
        if score > MAX_LONGEST_SCORE:
            keyed = longest_choice_keys(own)
            problems.append(f"topic {topic!r}: picking the longest choice scores {score:.0%} over its "
                            f"{singles_count(own)} single-answer questions (at most {MAX_LONGEST_SCORE:.0%} in "
                            f"each topic); the right choice is the unique longest in {len(keyed)} of them "
                            f"({', '.join(keyed)}): rebalance the lengths of their choices")
        chance = chance_score(own)
        closest = closest_choice_score(own)
        if closest > chance + TOPIC_CLOSEST_MARGIN + 1e-9:
            keyed = closest_choice_keys(own)
            problems.append(f"topic {topic!r}: picking the choice closest to the others scores {closest:.0%} over its "
                            f"{singles_count(own)} single-answer questions, where guessing scores {chance:.0%} (at most "
                            f"{chance + TOPIC_CLOSEST_MARGIN:.0%} in each topic); the right choice is the unique closest "
                            f"in {len(keyed)} of them ({', '.join(keyed)}): make their distractors differ from it in "
                            "more than one part")
        farthest = closest_choice_score(own, farthest=True)
        if farthest > chance + FARTHEST_MARGIN + 1e-9:
            problems.append(f"topic {topic!r}: picking the choice farthest from the others scores {farthest:.0%} over "
                            f"its {singles_count(own)} single-answer questions, where guessing scores {chance:.0%} (at "
                            f"most {chance + FARTHEST_MARGIN:.0%} in each topic): word the right choices like their "
                            "distractors")
    return problems


def near_duplicate_problems(questions: list[Question], threshold: float = NEAR_DUPLICATE) -> list[str]:
    """Pairs of questions whose question and right answers share most of their words."""
    words = {q.id: _content_words(q) for q in questions}
    problems = []
    for i, a in enumerate(questions):
        for b in questions[i + 1:]:
            wa, wb = words[a.id], words[b.id]
            if len(wa | wb) >= NEAR_DUPLICATE_MIN_WORDS and len(wa & wb) / len(wa | wb) >= threshold:
                problems.append(f"{a.id} and {b.id} are near-duplicates "
                                f"({len(wa & wb) / len(wa | wb):.0%} of their words shared): merge or rewrite")
    return problems


_STOP = frozenset("a an and are as at be by does do for from in into is it its of on or the this that "
                  "to what which with you your when how why each".split())


def _content_words(q: Question) -> frozenset[str]:
    text = q.text + " " + " ".join(q.choices[i] for i in sorted(q.correct))
    return frozenset(w for w in re.findall(r"[a-z_][a-z0-9_]+", text.lower()) if w not in _STOP)


