"""`batch --shard I/N` and `batch merge`: every submission graded exactly once across the shards, for
any N; merging refuses overlapping, missing and mismatched shards with one clear line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT
from grader import batch_output, shards
from grader.batch_output import Outcome, Submission
from grader.cli import main

NAMES = st.lists(st.text(alphabet="ab/_0", min_size=0, max_size=4), max_size=40)
UNIQUE_NAMES = st.lists(st.text(alphabet="abc/_01", min_size=1, max_size=6), unique=True, max_size=40)
COUNTS = st.integers(min_value=1, max_value=12)


@settings(max_examples=300, deadline=None)
@given(NAMES, COUNTS)
def test_every_submission_is_in_exactly_one_shard(names, count):
    parts = shards.split(names, count)
    assert len(parts) == count
    taken = sorted(k for part in parts for k in part)
    assert taken == list(range(len(names)))  # each position once: none lost, none twice
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1  # balanced


@settings(max_examples=200, deadline=None)
@given(UNIQUE_NAMES, COUNTS, st.randoms(use_true_random=False))
def test_the_split_does_not_depend_on_the_order_the_names_were_found_in(names, count, rnd):
    shuffled = list(names)
    rnd.shuffle(shuffled)
    for index in range(1, count + 1):
        shard = shards.Shard(index, count)
        mine = sorted(names[k] for k in shards.positions(names, shard))
        theirs = sorted(shuffled[k] for k in shards.positions(shuffled, shard))
        assert mine == theirs  # another machine listing the folder in another order grades the same files


def _outcome(name: str, status: str = "passed") -> Outcome:
    return Outcome(Submission(name, name), {"status": status, "exercise": "01", "checks": [], "seconds": 0.1})


def _pieces(names: list[str], count: int) -> list[shards.Piece]:
    """What N shard runs over ``names`` would write, read back through the JSON."""
    out = []
    for index in range(1, count + 1):
        shard = shards.Shard(index, count)
        graded = [_outcome(names[k]) for k in shards.positions(names, shard)]
        outcomes, field = batch_output.read_json(batch_output.render_json(graded, shards.record(names, shard)))
        out.append(shards.piece(f"shard-{index}.json", outcomes, field))
    return out


@settings(max_examples=150, deadline=None)
@given(NAMES, COUNTS, st.randoms(use_true_random=False))
def test_merging_every_shard_gives_every_submission_once_in_sorted_order(names, count, rnd):
    pieces = _pieces(names, count)
    rnd.shuffle(pieces)  # the order of the files on the command line does not matter
    merged = shards.merge(pieces)
    assert [o.submission.name for o in merged] == sorted(names)


def test_shard_numbers_are_parsed_and_bad_ones_explained():
    assert shards.parse("2/8") == shards.Shard(2, 8) and shards.parse(" 1 / 1 ") == shards.Shard(1, 1)
    for text, words in [("0/4", "$((INDEX + 1))/N"), ("5/4", "numbered 1 to 4"), ("1/0", "at least 1"),
                        ("2", "I/N"), ("a/b", "I/N"), ("-1/4", "numbered 1 to 4")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            shards.parse(text)


def test_merge_refuses_a_missing_shard_and_names_it_and_a_submission_it_holds():
    pieces = _pieces(["alice", "bob", "carol", "dave"], 3)
    with pytest.raises(shards.MergeError, match=r"missing shard 2/3: 1 submission not graded, e\.g\. bob"):
        shards.merge([pieces[0], pieces[2]])


def test_merge_refuses_overlapping_shards():
    pieces = _pieces(["alice", "bob", "carol"], 2)
    with pytest.raises(shards.MergeError, match=r"overlapping shards: shard 1/2 is in both shard-1.json and "
                                                r"shard-1.json"):
        shards.merge([pieces[0], pieces[0], pieces[1]])


def test_merge_refuses_shards_of_different_splits_or_different_submissions():
    names = ["alice", "bob", "carol"]
    with pytest.raises(shards.MergeError, match="different numbers of shards: shard-1.json is shard 1/2, "
                                                "shard-2.json is shard 2/3"):
        shards.merge([_pieces(names, 2)[0], _pieces(names, 3)[1]])
    other = _pieces(names + ["erin"], 2)
    with pytest.raises(shards.MergeError, match="cut from different submissions \\(3 and 4; 'erin' is only in"):
        shards.merge([_pieces(names, 2)[0], other[1]])


def test_merge_refuses_an_output_that_does_not_hold_what_its_shard_grades():
    names = ["alice", "bob", "carol"]
    first, second = _pieces(names, 2)
    first.outcomes = first.outcomes[:-1] + [_outcome("bob")]  # edited by hand, or another split's rows
    with pytest.raises(shards.MergeError, match="shard-1.json does not hold what shard 1/2 grades"):
        shards.merge([first, second])


def _write_shards(folder: Path, names: list[str], count: int, statuses: dict | None = None) -> list[str]:
    paths = []
    for index in range(1, count + 1):
        shard = shards.Shard(index, count)
        graded = [_outcome(names[k], (statuses or {}).get(names[k], "passed")) for k in shards.positions(names, shard)]
        path = folder / f"shard-{index}.json"
        path.write_text(batch_output.render_json(graded, shards.record(names, shard)))
        paths.append(str(path))
    return paths


def test_the_merge_command_writes_each_format_and_exits_with_the_worst_result(tmp_path):
    paths = _write_shards(tmp_path, ["alice", "bob", "carol"], 2, {"bob": "failed"})
    runner = CliRunner()
    table = runner.invoke(main, ["batch", "merge", *paths])
    assert table.exit_code == 1, table.output
    assert table.output.splitlines()[-1] == "3 submissions: 2 passed, 1 failed, 0 timed out, 0 could not be graded " \
                                            "(exit 1)."
    merged = runner.invoke(main, ["batch", "merge", *reversed(paths), "--format", "json", "-o",
                                  str(tmp_path / "all.json"), "--junit", str(tmp_path / "all.xml")])
    data = json.loads(merged.output)
    assert [r["submission"] for r in data["reports"]] == ["alice", "bob", "carol"]
    assert json.loads((tmp_path / "all.json").read_text())["reports"] == data["reports"]
    assert "shard" not in data  # a merged result is whole
    assert (tmp_path / "all.xml").read_text().count("<testsuite ") == 3
    csv_out = runner.invoke(main, ["batch", "merge", *paths, "--format", "csv"])
    assert csv_out.output.splitlines()[0].split(",") == batch_output.ROW_FIELDS
    markdown = runner.invoke(main, ["batch", "merge", *paths, "--format", "markdown"])
    assert markdown.output.startswith("| submission | exercise |") and "| bob | 01 | failed |" in markdown.output


def test_the_merge_command_refuses_with_one_line_and_exit_2(tmp_path):
    paths = _write_shards(tmp_path, ["alice", "bob", "carol"], 3)
    (tmp_path / "rows.csv").write_text("submission,file\nalice,alice\n")
    (tmp_path / "other.json").write_text('{"rows": []}')
    cases = [
        ([paths[0], paths[2]], "missing shard 2/3"),
        ([paths[0], paths[1], paths[1], paths[2]], "overlapping shards: shard 2/3"),
        ([paths[0], str(tmp_path / "nope.json")], "cannot read"),
        ([str(tmp_path / "rows.csv")], "rows.csv"),
        ([str(tmp_path / "other.json")], "not the JSON output of `ddp-grade batch`"),
    ]
    for args, words in cases:
        result = CliRunner().invoke(main, ["batch", "merge", *args, "-o", str(tmp_path / "merged.json")])
        assert result.exit_code == 2, (args, result.output)
        assert words in result.output and "Traceback" not in result.output, result.output
        assert not (tmp_path / "merged.json").exists()  # nothing written when refused


def test_a_bad_shard_option_is_refused_before_anything_starts(tmp_path):
    result = CliRunner().invoke(main, ["batch", str(tmp_path), "--shard", "0/4"])
    assert result.exit_code == 2 and "shards are numbered 1 to 4" in result.output


@pytest.mark.slow
def test_shards_of_a_real_batch_grade_each_submission_once_and_merge_into_the_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    learners = tmp_path / "class"
    for name, source in [("alice", ROOT / "solutions" / "01_setup.py"),
                         ("bob", ROOT / "tests" / "hostile" / "01_not_utf8.py"),
                         ("carol", ROOT / "tests" / "hostile" / "01_empty.py")]:
        (learners / name).mkdir(parents=True)
        shutil.copy(source, learners / name / "01_setup.py")
    (learners / "dave").mkdir()  # handed in nothing
    paths = []
    for index in (2, 1):  # the order the machines finish in does not matter
        out = tmp_path / f"shard-{index}.json"
        result = CliRunner().invoke(main, ["batch", str(learners), "--shard", f"{index}/2", "-o", str(out),
                                           "--timeout", "30", "-q"])
        assert result.exit_code in (0, 1, 2), result.output
        assert f"(shard {index}/2: 2 of the 4 submissions)" in result.output
        paths.append(str(out))
    graded = [r["submission"] for p in paths for r in json.loads(Path(p).read_text())["reports"]]
    assert sorted(graded) == sorted(["alice/01_setup.py", "bob/01_setup.py", "carol/01_setup.py",
                                     str(learners / "dave")])
    merged = CliRunner().invoke(main, ["batch", "merge", *paths, "--format", "json"])
    data = json.loads(merged.output)
    status = {r["submission"]: r["status"] for r in data["reports"]}
    assert status == {"alice/01_setup.py": "passed", "bob/01_setup.py": "unusable", "carol/01_setup.py": "unusable",
                      str(learners / "dave"): "unusable"}
    assert merged.exit_code == data["exit_code"] == 2


def test_equal_names_keep_their_given_order():
    # The same path given twice is graded twice, once in each of two shards (the split is a function of the list).
    assert shards.split(["b", "a", "b", "a"], 2) == [[1, 0], [3, 2]]
