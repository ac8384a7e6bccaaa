"""One question of the quiz bank, as :mod:`grader.quiz.bank` reads it and every other module of the quiz takes it."""

from __future__ import annotations

from dataclasses import dataclass

LETTERS = "abcde"


@dataclass(frozen=True)
class Question:
    """One multiple-choice question, with its choices in the order of the bank file."""

    id: str
    topic: str
    difficulty: str
    text: str
    choices: tuple[str, ...]
    answer_letters: tuple[str, ...]
    """Letters of the correct choices, referring to ``choices`` as written in the file."""
    multi: bool
    """True for a choose-all-that-apply question (answer given as a list)."""
    explanation: str
    sources: tuple[str, ...]
    """Where the claim can be read: ``torch/<file>.py::Name`` or a docs URL with ``#anchor`` (one or more)."""
    demos: tuple[str, ...] = ()
    """``tests/quiz_demos/test_<x>.py::test_<y>``: the tests that run the claim on the installed torch."""
    checked: str = ""
    """The torch version the question was last checked against, e.g. ``2.13.0``."""
    origin: str = ""
    """The file the question came from (for error messages)."""

    @property
    def source(self) -> str:
        """The sources as one line (for the screen and the JSON output)."""
        return "; ".join(self.sources)

    @property
    def demo(self) -> str:
        """The demonstrations as one line; empty when the claim is only cited."""
        return "; ".join(self.demos)

    @property
    def correct(self) -> frozenset[int]:
        """Indices into ``choices`` of the correct answers (letters outside the choices are dropped)."""
        return frozenset(
            LETTERS.index(letter)
            for letter in self.answer_letters
            if letter in LETTERS and LETTERS.index(letter) < len(self.choices)
        )
