"""The question bank: TOML files in ``grader/quiz/bank/``, loaded into dataclasses and validated.

One file per topic, ``<topic>.toml``::

    topic = "sampler"

    [[question]]
    id = "sampler-set-epoch-01"
    difficulty = "easy"              # easy | medium | hard
    question = "..."
    choices = ["...", "...", "..."]  # 3 to 5, in the order the letters below refer to
    answer = "b"                     # one letter: single choice; a list ["a", "c"]: choose all that apply
    explanation = "..."              # never refers to a choice by position or letter (choices are shuffled)
    source = "torch/utils/data/distributed.py::DistributedSampler.__iter__"   # or a docs/paper URL with #anchor (or a list)
    demo = "tests/quiz_demos/test_sampler.py::test_padding"   # where the claim runs on CPU (or a list)
    checked = "2.13.0"               # the torch version the question was checked against

Loading is lenient (a missing field becomes empty); :func:`validate_bank` reports every problem
of the questions and of the bank as a whole (the giveaway rules: the longest choice and the choice
closest to the others or farthest from them, over the bank and over each topic, recurring words,
qualifying clauses, reasons, absolute words), :func:`count_problems` the size
thresholds. ``python -m grader.quiz.bank`` prints both and the giveaway figures, for the whole bank
and for each topic.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import tomllib
from pathlib import Path

from grader.quiz.giveaways import (
    chance_score,
    closest_choice_score,
    elimination_score,
    giveaway_problems,
    longest_choice_score,
    multi_answer_counts,
    near_duplicate_problems,
    qualifier_score,
    reason_elimination_score,
    recurring_choice_score,
    singles_count,
    topic_giveaway_problems,
)
from grader.quiz.question import LETTERS, Question


BANK_DIR = Path(__file__).parent / "bank"
REPO_ROOT = BANK_DIR.parents[2]
"""The checkout the bank lives in (demos are named relative to it)."""

#: Known topics, in the order they are listed, with a one-line title each.
TOPICS: dict[str, str] = {
    "core": "Core idea and math of data parallelism",
    "sampler": "Data sharding and DistributedSampler",
    "collectives": "Collectives and the ring all-reduce",
    "launch": "Launching processes: mp.spawn, torchrun, backends",
    "internals": "DDP internals: broadcast, buckets, hooks, options",
    "accumulation": "Gradient accumulation and no_sync",
    "checkpoint": "Checkpointing under DDP",
    "debugging": "Debugging hangs, timeouts and errors",
    "beyond": "Beyond DDP: DataParallel, FSDP/ZeRO, SyncBatchNorm",
    "tensor-parallel": "Tensor parallelism: column and row splits, Megatron's f and g, sequence parallelism",
    "parallel-groups": "Process groups by hand: new_group on every rank, subgroups, 2-D data x tensor layouts",
    "pipeline-parallel": "Pipeline parallelism: GPipe, 1F1B, bubbles and activation memory",
    "context-parallel": "Context parallelism: ring attention, the online softmax, causal load balancing",
    "ulysses": "Ulysses: all-to-all context parallelism, heads against sequence, when it beats ring attention",
    "expert-parallel": "Expert parallelism: top-k routing, capacity and dropped tokens, all-to-all, load balancing",
    "sequence-parallel": "Sequence parallelism: norms on chunks, all-gather and reduce-scatter, replicated gradients",
    "sharding": "ZeRO stage 3 by hand: slices, padding, gathers, freeing memory",
    "mixed-precision": "Mixed precision with DDP: autocast, GradScaler, bf16 vs fp16",
    "float8": "Float8 training: E4M3 and E5M2, scales from the amax, torch._scaled_mm, FSDP2's float8 all-gather",
    "elastic": "torchrun and process groups: rendezvous, restarts, object collectives",
    "compile": "DDP with torch.compile: DDPOptimizer, optimize_ddp, compiled autograd",
    "nccl": "NCCL and torch NCCL settings: debugging, interfaces, timeouts, flight recorder",
    "comm-hooks": "DDP communication hooks: compression, PowerSGD, the GradBucket contract",
    "dcp": "Distributed checkpoints: torch.distributed.checkpoint and resharding",
    "fsdp": "FSDP: fully_shard, resharding, sharding strategies, DeviceMesh, HSDP",
    "dtensor": "DeviceMesh and DTensor: 2-D meshes, placements, parallel styles, FSDP2 over tensor parallelism",
    "fsdp2": "FSDP2 in production: MixedPrecisionPolicy, reshard_after_forward, CPU offload, clipping DTensors",
    "hybrid-sharding": "Hybrid sharding (HSDP) and recovery from a live peer: 2-D meshes, their collectives, torchft",
    "memory": "Memory under DDP: activation checkpointing, buckets, optimizer state",
    "capacity": "Capacity planning: bytes per rank (ZeRO, activations), traffic, FLOPs, step time, plans",
    "resilience": "Resilience at scale: failure rates, goodput, checkpoint intervals, asynchronous saves, restarts",
    "rl-weight-sync": "RL weight sync: a sharded trainer's weights to an inference engine's tensor-parallel layout",
    "debug-jobs": "Debugging broken DDP jobs: hangs, unused parameters, drift, data order, syncs, resumes",
    "overlap": "Hiding communication: prefetching, reduce-scatter under backward, streams, async TP, zero-bubble pipelines",
}
DIFFICULTIES = ("easy", "medium", "hard")
MIN_CHOICES, MAX_CHOICES = 3, 5
MIN_PER_TOPIC, MIN_TOTAL, MIN_TOPICS = 6, 150, 14
MULTI_MARK = "choose all that apply"
MIN_EXPLANATION_CHARS = 80
VERSION_PATTERN = re.compile(r"^\d+\.\d+\.\d+$")

#: Hosts a source URL may point to: PyTorch's docs and tutorials, GitHub (e.g. nccl-tests' notes), and
#: ar5iv's HTML of arXiv papers, whose anchors name a section (``#S3.SS1``) or an appendix (``#A1``).
SOURCE_HOSTS = ("docs.pytorch.org", "pytorch.org", "github.com", "ar5iv.labs.arxiv.org")
#: ``torch/<path>.py::Name.attr`` with an optional ``#L10-L40`` line range.
SOURCE_PATH = re.compile(r"^(?P<path>torch/[\w/.-]+\.py)::(?P<name>[A-Za-z_][\w.]*)(?:#L(?P<first>\d+)-L(?P<last>\d+))?$")
SOURCE_URL = re.compile(r"^https://(?P<host>[\w.-]+)/\S*#(?P<anchor>\S+)$")
#: ``docs/<name>.md#section``: a section of the kit's own reference, for a claim the kit derives (its models).
SOURCE_DOC = re.compile(r"^(?P<path>docs/[\w.-]+\.md)#(?P<anchor>[\w-]+)$")
DEMO = re.compile(r"^(?P<path>tests/quiz_demos/test_[\w]+\.py)::(?P<name>test_\w+)$")

#: Explanations must not point at a choice by position or letter: choices are shuffled on screen.
POSITION_WORDS = re.compile(
    r"\b(?:first|second|third|fourth|fifth|last|above|below|previous|next)\s+(?:choice|option|answer)s?\b"
    r"|\b(?:choice|option|answer|letter)s?\s+(?:\([a-e]\)|[a-e]\)|[b-e]\b|a(?=[,.;:!?)]|$))"
    r"|(?:^|\s)\([a-e]\)\s"
    r"|\b(?:choice|option|answer)\s+(?:one|two|three|four|five|[1-5])\b",
    re.IGNORECASE,
)
_DETACHED = re.compile(
    r"\b(?:as before|as above|see above|the above|above question"
    r"|(?:previous|preceding|earlier|last|other) (?:question|example|scenario|setup|exercise))\b",
    re.IGNORECASE,
)
#: "the same X", "that X", "this X", "these X", "those X": they need an X earlier in the stem.
_ANAPHOR = re.compile(r"\b(?=(?P<det>the same|that|this|these|those)\s+(?P<head>[^.,;:?!()]*))", re.IGNORECASE)
#: Words before "that" after which it points at something ("in that MLP", "make that model",
#: "what does that entry hold"); elsewhere "that" joins clauses ("so that", "a hook that logs").
_POINTING_THAT = frozenset(
    "in on of for from with to into at by about under after before over make makes does do did is are was "
    "were can could will would should hold holds keep keeps use uses".split())
#: Words after "that" that show it joins clauses rather than points ("that the", "that all apply").
_JOINING = frozenset("a an the all each every it its they their them apply no not only "
                     "this these those his her one some any".split())
#: A sentence where "the same" compares things inside it: "the same loss on every rank" (and
#: "the same batch as on 1 GPU", an "as" right after it).
_DISTRIBUTIVE = re.compile(r"\b(?:every|each|all|both|across|between)\b", re.IGNORECASE)
_NUMBER_WORDS = frozenset("one two three four five six seven eight nine ten".split())


class BankError(Exception):
    """A bank file that cannot be parsed at all (bad TOML, wrong types)."""


def load_bank(directory: Path | None = None) -> list[Question]:
    """Every question of every ``*.toml`` file in ``directory`` (the packaged bank by default)."""
    directory = directory or BANK_DIR
    questions: list[Question] = []
    for path in sorted(directory.glob("*.toml")):
        questions.extend(parse_bank_file(path))
    return questions


def parse_bank_file(path: Path) -> list[Question]:
    """The questions of one bank file; raise :class:`BankError` when it is not usable TOML."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BankError(f"{path.name}: {exc}") from exc
    topic = data.get("topic", path.stem)
    entries = data.get("question", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise BankError(f"{path.name}: [[question]] must be a list of tables")
    return [_question_from_entry(entry, str(topic), path.name) for entry in entries]


def _question_from_entry(entry: dict, topic: str, origin: str) -> Question:
    answer = entry.get("answer", [])
    multi = isinstance(answer, list)
    letters = answer if multi else [answer]
    source, demo = entry.get("source"), entry.get("demo")
    sources = source if isinstance(source, list) else [source]
    demos = demo if isinstance(demo, list) else [demo]
    return Question(
        id=_text(entry.get("id")),
        topic=_text(entry.get("topic", topic)),
        difficulty=_text(entry.get("difficulty")),
        text=_text(entry.get("question")),
        choices=tuple(_text(c) for c in entry.get("choices", [])),
        answer_letters=tuple(_text(a).lower() for a in letters),
        multi=multi,
        explanation=_text(entry.get("explanation")),
        sources=tuple(t for t in (_text(s) for s in sources) if t),
        demos=tuple(t for t in (_text(d) for d in demos) if t),
        checked=_text(entry.get("checked")),
        origin=origin,
    )


def _text(value) -> str:
    return value.strip() if isinstance(value, str) else ("" if value is None else str(value))


# --- validation ------------------------------------------------------------------------------------

def validate_bank(questions: list[Question], torch_root: Path | None = None,
                  repo_root: Path | None = REPO_ROOT) -> list[str]:
    """Every problem of the questions and of the bank as a whole, one line each; empty means sound.

    ``torch_root`` is the installed ``torch`` package that ``torch/...`` sources are checked in
    (found without importing torch when None); ``repo_root`` the checkout ``demo`` paths are
    relative to. The size thresholds are separate: :func:`count_problems`.
    """
    torch_root = torch_root or installed_torch_root()
    if repo_root is not None and not (repo_root / "tests").is_dir():
        repo_root = None  # an installed copy without the tests: demos cannot be looked up
    problems: list[str] = []
    seen: set[str] = set()
    for q in questions:
        if q.id in seen:
            problems.append(f"{q.origin}: duplicate id {q.id!r}")
        seen.add(q.id)
        found = question_problems(q) + reference_problems(q, torch_root, repo_root)
        problems.extend(f"{q.origin}: {q.id or '<no id>'}: {p}" for p in found)
    problems.extend(giveaway_problems(questions))
    problems.extend(topic_giveaway_problems(questions))
    problems.extend(near_duplicate_problems(questions))
    return problems


def question_problems(q: Question) -> list[str]:
    """The problems of one question on its own (not its references to files)."""
    problems = []
    if not q.id:
        problems.append("missing id")
    if q.topic not in TOPICS:
        problems.append(f"unknown topic {q.topic!r}")
    if q.difficulty not in DIFFICULTIES:
        problems.append(f"unknown difficulty {q.difficulty!r}")
    if not q.text:
        problems.append("missing question text")
    if not MIN_CHOICES <= len(q.choices) <= MAX_CHOICES:
        problems.append(f"{len(q.choices)} choices (want {MIN_CHOICES} to {MAX_CHOICES})")
    if any(not c for c in q.choices):
        problems.append("empty choice")
    if len({c.casefold() for c in q.choices}) != len(q.choices):
        problems.append("duplicate choice")
    if not q.answer_letters or not any(q.answer_letters):
        problems.append("no correct answer")
    for letter in q.answer_letters:
        if letter and (letter not in LETTERS or LETTERS.index(letter) >= len(q.choices)):
            problems.append(f"answer {letter!r} is not among the choices")
    if len(set(q.answer_letters)) != len(q.answer_letters):
        problems.append("an answer letter is repeated")
    if q.multi != (MULTI_MARK in q.text.lower()):
        problems.append(f"a multi-select question (and only one) must say {MULTI_MARK!r}")
    if not q.multi and len(q.correct) == 1 and max(map(len, q.choices), default=0) > 0:
        lengths = [len(c) for c in q.choices]
        right = lengths[next(iter(q.correct))]
        if right == max(lengths) and lengths.count(right) == 1 and right > 1.5 * sorted(lengths)[-2]:
            problems.append(f"the right choice ({right} characters) is by far the longest "
                            f"(next {sorted(lengths)[-2]}): write distractors as specific as the answer")
    for phrase in leaning_phrases(q.text):
        problems.append(f"the question leans on another question ({phrase!r} has nothing it refers to in "
                        "the question itself): questions are shuffled, so say in the question what it means")
    if len(q.explanation) < MIN_EXPLANATION_CHARS:
        problems.append("missing or too short explanation")
    match = POSITION_WORDS.search(q.explanation)
    if match:
        problems.append(f"the explanation points at a choice by position ({match.group(0).strip()!r}); "
                        "choices are shuffled on screen: name the choice by what it says")
    if not q.sources:
        problems.append("missing source (a docs URL with #anchor, torch/<file>.py::Name or docs/<name>.md#section)")
    if not q.checked:
        problems.append('missing checked (the torch version the question was checked against, e.g. "2.13.0")')
    elif not VERSION_PATTERN.match(q.checked):
        problems.append(f"checked {q.checked!r} is not a version like 2.13.0")
    return problems


def leaning_phrases(text: str) -> list[str]:
    """Phrases of a question's text that point at another question: "as before", "the previous
    question", or "the same X" / "that X" / "this X" whose X appears nowhere earlier in the text.

    "The same" comparing things within one sentence ("the same loss on every rank", "the same batch
    as on 1 GPU") and "that" joining clauses ("so that the", "a hook that logs") are not refused, nor
    "of these" (the choices).
    """
    found = [m.group(0) for m in _DETACHED.finditer(text)]
    for match in _ANAPHOR.finditer(text):
        det, head = match.group("det").lower(), match.group("head")
        words = re.findall(r"[A-Za-z_][\w-]*|\d+", head)
        if not words:
            continue
        before = text[:match.start()]
        previous = re.findall(r"[A-Za-z_]+", before)[-1:]
        if det == "that" and (words[0].lower() in _JOINING
                              or (previous and previous[0].lower() not in _POINTING_THAT)):
            continue
        if det in ("these", "those") and previous and previous[0].lower() == "of":
            continue
        if det == "the same":
            start = max(before.rfind(". "), before.rfind("? "), before.rfind("! "))
            end = re.search(r"[.?!](?:\s|$)", text[match.end():])
            sentence = text[start + 1:match.end() + (end.start() if end else len(text))]
            if _DISTRIBUTIVE.search(sentence) or "as" in [w.lower() for w in words[:4]]:
                continue
        # The noun the phrase points at is among its first words ("that MLP", "the same four 1 MiB
        # layers"): one of them, or a part of a compound ("micro-batch"), must come earlier.
        heads = [part for w in words[:3] if not w.isdigit() and w.lower() not in _NUMBER_WORDS
                 for part in re.split(r"[-_]", w) if part]
        earlier = {_word_stem(w) for w in re.findall(r"[A-Za-z_]+", before)}
        if not any(_has_antecedent(_word_stem(w), earlier) for w in heads):
            found.append(f"{match.group('det')} {' '.join(words[:3])}")
    return found


def _word_stem(word: str) -> str:
    """A crude stem, enough to match "gathers" with "gather" and "entries" with "entry"."""
    word = word.lower()
    if len(word) > 4:
        word = re.sub(r"ies$", "y", word)
        word = re.sub(r"(?:es|s|ed|ing)$", "", word)
    return word


def _has_antecedent(word: str, earlier: set[str]) -> bool:
    """Whether ``word`` or a word it begins, or that begins it ("scale", "scaler"), came earlier."""
    return word in earlier or (len(word) >= 4 and any(len(e) >= 4 and (e.startswith(word) or word.startswith(e))
                                                       for e in earlier))


def reference_problems(q: Question, torch_root: Path | None, repo_root: Path | None) -> list[str]:
    """Sources that do not name a place holding the claim, and a demo that names no test."""
    problems = [p for source in q.sources for p in source_problems(source, torch_root, repo_root)]
    problems.extend(p for demo in q.demos for p in demo_problems(demo, repo_root))
    return problems


def source_problems(source: str, torch_root: Path | None, repo_root: Path | None = None) -> list[str]:
    """Why ``source`` does not point at a precise place: a URL needs an anchor on a known host; a
    torch path must exist in the installed torch and define the name after ``::``; a kit document
    (``docs/<name>.md#section``) must exist in the checkout and have a heading with that anchor."""
    doc = SOURCE_DOC.match(source)
    if doc:
        if repo_root is None:
            return []
        file = repo_root / doc.group("path")
        if not file.is_file():
            return [f"source {source!r}: {doc.group('path')} does not exist"]
        anchors = {heading_anchor(line) for line in file.read_text(encoding="utf-8").splitlines()
                   if line.startswith("#")}
        if doc.group("anchor") not in anchors:
            return [f"source {source!r}: {doc.group('path')} has no section #{doc.group('anchor')}"]
        return []
    if source.startswith("https://"):
        url = SOURCE_URL.match(source)
        if not url:
            return [f"source {source!r} has no #anchor: link the section that holds the claim"]
        host = url.group("host")
        if host not in SOURCE_HOSTS:
            return [f"source {source!r}: host {host!r} is not one of {', '.join(SOURCE_HOSTS)}"]
        return []
    path = SOURCE_PATH.match(source)
    if not path:
        return [f"source {source!r} is not a docs URL with #anchor, torch/<file>.py::Name or docs/<name>.md#section"]
    if torch_root is None:
        return [f"source {source!r}: torch is not installed, so the path cannot be checked"]
    file = torch_root.parent / path.group("path")
    if not file.is_file():
        return [f"source {source!r}: {path.group('path')} does not exist in the installed torch"]
    text = file.read_text(encoding="utf-8")
    if path.group("first"):
        first, last, lines = int(path.group("first")), int(path.group("last")), text.count("\n") + 1
        if not 1 <= first <= last <= lines:
            return [f"source {source!r}: lines {first}-{last} are outside the file ({lines} lines)"]
    if not _defines(str(file), path.group("name")):
        return [f"source {source!r}: {path.group('path')} defines no {path.group('name')!r}"]
    return []


def heading_anchor(line: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as dashes."""
    text = line.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def demo_problems(demo: str, repo_root: Path | None) -> list[str]:
    """Why ``demo`` does not name an existing test function in ``tests/quiz_demos/``."""
    match = DEMO.match(demo)
    if not match:
        return [f"demo {demo!r} is not tests/quiz_demos/test_<name>.py::test_<name>"]
    if repo_root is None:
        return []
    file = repo_root / match.group("path")
    if not file.is_file():
        return [f"demo {demo!r}: {match.group('path')} does not exist"]
    if not _defines(str(file), match.group("name")):
        return [f"demo {demo!r}: {match.group('path')} has no function {match.group('name')!r}"]
    return []


def installed_torch_root() -> Path | None:
    """The installed ``torch`` package folder, found without importing torch (None when absent)."""
    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).parent if spec and spec.origin else None


@functools.lru_cache(maxsize=None)
def _definitions(file: str) -> frozenset[str]:
    """Dotted names a Python file defines: ``f``, ``C``, ``C.method``, ``C.attr``, ``C.Inner.m``, ``NAME``."""
    try:
        tree = ast.parse(Path(file).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return frozenset()
    names: set[str] = set()

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + node.name)
                if isinstance(node, ast.ClassDef):
                    visit(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Name):
                            names.add(prefix + t.id)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body, prefix)
                visit(getattr(node, "orelse", []), prefix)

    visit(tree.body, "")
    return frozenset(names)


def _defines(file: str, name: str) -> bool:
    return name in _definitions(file)


def count_problems(questions: list[Question], min_per_topic: int = MIN_PER_TOPIC, min_total: int = MIN_TOTAL,
                   min_topics: int = MIN_TOPICS) -> list[str]:
    """The size thresholds: questions in all, topics, questions per topic."""
    problems = []
    if len(questions) < min_total:
        problems.append(f"{len(questions)} questions in all (want at least {min_total})")
    if len(TOPICS) < min_topics:
        problems.append(f"{len(TOPICS)} topics (want at least {min_topics})")
    counts = topic_counts(questions)
    for topic in TOPICS:
        if counts.get(topic, 0) < min_per_topic:
            problems.append(f"topic {topic!r} has {counts.get(topic, 0)} questions (want at least {min_per_topic})")
    return problems


def bank_figures(questions: list[Question]) -> dict:
    """The giveaway figures of a bank (for ``python -m grader.quiz.bank`` and reports)."""
    singles = sum(1 for q in questions if not q.multi)
    return {
        "questions": len(questions),
        "single_answer": singles,
        "multi_select": len(questions) - singles,
        "longest_choice_score": round(longest_choice_score(questions), 3),
        "qualifier_score": round(qualifier_score(questions), 3),
        "fewest_qualifier_score": round(qualifier_score(questions, fewest=True), 3),
        "reason_elimination_score": round(reason_elimination_score(questions), 3),
        "elimination_score": round(elimination_score(questions), 3),
        "chance_score": round(chance_score(questions), 3),
        "closest_choice_score": round(closest_choice_score(questions), 3),
        "farthest_choice_score": round(closest_choice_score(questions, farthest=True), 3),
        "recurring_choice_score": round(recurring_choice_score(questions), 3),
        "multi_answer_counts": multi_answer_counts(questions),
        "with_demo": sum(1 for q in questions if q.demos),
    }


def topic_figures(questions: list[Question]) -> dict[str, dict[str, float]]:
    """The giveaway figures of each topic's single-answer questions, in the order of TOPICS (the
    limits on the longest choice, the closest choice and the farthest apply to each topic as well as
    to the whole bank; the others to the whole bank, and a topic far above them is where to rebalance
    first)."""
    figures = {}
    for topic in [*TOPICS, *sorted({q.topic for q in questions} - set(TOPICS))]:
        own = [q for q in questions if q.topic == topic]
        if any(not q.multi for q in own):
            figures[topic] = {"single_answer": singles_count(own),
                              "longest_choice_score": round(longest_choice_score(own), 3),
                              "qualifier_score": round(qualifier_score(own), 3),
                              "fewest_qualifier_score": round(qualifier_score(own, fewest=True), 3),
                              "reason_elimination_score": round(reason_elimination_score(own), 3),
                              "closest_choice_score": round(closest_choice_score(own), 3),
                              "farthest_choice_score": round(closest_choice_score(own, farthest=True), 3),
                              "recurring_choice_score": round(recurring_choice_score(own), 3)}
    return figures


def topic_counts(questions: list[Question]) -> dict[str, int]:
    """Number of questions per topic."""
    counts: dict[str, int] = {}
    for q in questions:
        counts[q.topic] = counts.get(q.topic, 0) + 1
    return counts


def main() -> int:
    """Print the bank's problems and giveaway figures; exit 1 when there is a problem."""
    questions = load_bank()
    problems = validate_bank(questions) + count_problems(questions)
    for line in problems:
        print(line)
    for key, value in bank_figures(questions).items():
        print(f"{key}: {value}")
    print("per topic, over its single-answer questions: longest choice, most qualifying clauses, "
          "fewest qualifying clauses, reasons struck out, closest to the others, farthest, most recurring words")
    for topic, figures in topic_figures(questions).items():
        print(f"  {topic}: {figures['single_answer']} questions: {figures['longest_choice_score']:.0%}, "
              f"{figures['qualifier_score']:.0%}, {figures['fewest_qualifier_score']:.0%}, "
              f"{figures['reason_elimination_score']:.0%}, {figures['closest_choice_score']:.0%}, "
              f"{figures['farthest_choice_score']:.0%}, {figures['recurring_choice_score']:.0%}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
