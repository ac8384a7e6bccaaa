"""What a submission leaves and sends is read so that nothing in it can hurt the grader: files (no
links, no FIFOs, nothing outside the grading's folder, sizes capped), text (no terminal control),
the sandbox's answers (checked field by field) and reports (no unknown status)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading

import pytest
import torch

from grader.rank import untrusted
from grader.sandbox import boundary
from grader.results import Report, report_from_dict


@pytest.fixture
def folder(tmp_path):
    """A grading's own folder, as a session registers it (and a place outside it)."""
    inside = tmp_path / "grading"
    inside.mkdir()
    untrusted.trust_folder(str(inside))
    yield inside
    untrusted.forget_folder(str(inside))


def test_a_regular_file_is_read_and_a_large_one_refused(folder):
    (folder / "log.jsonl").write_bytes(b"x" * 100)
    assert untrusted.read_bytes(str(folder / "log.jsonl")) == b"x" * 100
    with pytest.raises(untrusted.Unreadable, match="holds 100 bytes; the grader reads at most 99"):
        untrusted.read_bytes(str(folder / "log.jsonl"), limit=99)


def test_a_fifo_is_refused_without_blocking(folder):
    os.mkfifo(folder / "log.jsonl")
    done = []

    def read():
        try:
            untrusted.read_bytes(str(folder / "log.jsonl"))
        except untrusted.Unreadable as exc:
            done.append(str(exc))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    assert done and "not a regular file (a FIFO)" in done[0]


def test_a_link_anywhere_below_the_folder_is_refused(folder, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET")
    (folder / "model.pt").symlink_to(secret)
    (folder / "out").symlink_to(tmp_path)
    for path in (folder / "model.pt", folder / "out" / "secret.txt"):
        with pytest.raises(untrusted.Unreadable, match="symbolic link"):
            untrusted.read_bytes(str(path))


def test_a_folder_held_open_is_read_by_the_name_it_has_elsewhere(tmp_path):
    """A sandbox's folder is named, in every path, by the name it has inside the sandbox, and read through a
    descriptor of it: nothing of this machine's by that name is read, and links below it are refused."""
    held = tmp_path / "held"
    (held / "run1").mkdir(parents=True)
    (held / "run1" / "a.txt").write_bytes(b"inside")
    (held / "run1" / "link").symlink_to(held / "run1" / "a.txt")
    name = f"/nonexistent-{os.getpid()}/ddp-grade-ranks-x"
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    untrusted.trust_folder(name, through=fd)
    try:
        assert untrusted.read_bytes(f"{name}/run1/a.txt") == b"inside"
        assert untrusted.exists(f"{name}/run1/a.txt") and not untrusted.exists(f"{name}/run1/b.txt")
        assert untrusted.exists(f"{name}/run1/link") and untrusted.is_folder(f"{name}/run1")
        assert untrusted.lstat(f"{name}/run1/a.txt").st_size == 6
        assert untrusted.list_files(f"{name}/run1") == [f"{name}/run1/a.txt"]
        with pytest.raises(untrusted.Unreadable, match="symbolic link"):
            untrusted.read_bytes(f"{name}/run1/link")
    finally:
        untrusted.forget_folder(name)
        os.close(fd)
    with pytest.raises(untrusted.Unreadable, match="outside the grading's own folder"):
        untrusted.read_bytes(f"{name}/run1/a.txt")


def test_nothing_outside_a_grading_folder_is_read(folder):
    elsewhere = tempfile.mkdtemp()  # not under the tests' own folders, which the tests trust
    try:
        with open(os.path.join(elsewhere, "secret.txt"), "w") as f:
            f.write("x")
        with pytest.raises(untrusted.Unreadable, match="outside the grading's own folder"):
            untrusted.read_bytes(os.path.join(elsewhere, "secret.txt"))
        (folder / "up").mkdir()
        with pytest.raises(untrusted.Unreadable, match="leaves the grading's folder|outside"):
            untrusted.read_bytes(str(folder / "up" / ".." / ".." / ".." / ".." / elsewhere.lstrip("/") / "secret.txt"))
    finally:
        shutil.rmtree(elsewhere)


def test_listing_leaves_out_links_and_fifos_and_follows_nothing(folder, tmp_path):
    (folder / "a").mkdir()
    (folder / "a" / "shard.bin").write_bytes(b"1")
    os.mkfifo(folder / "a" / "pipe")
    (folder / "a" / "link").symlink_to(folder / "a" / "shard.bin")
    (folder / "away").symlink_to(tmp_path)
    assert untrusted.list_files(str(folder), recursive=True) == [str(folder / "a" / "shard.bin")]


def test_a_checkpoint_is_loaded_with_weights_only(folder):
    torch.save({"w": torch.ones(2)}, folder / "ok.pt")
    assert torch.equal(untrusted.load_tensors(str(folder / "ok.pt"))["w"], torch.ones(2))

    class Run:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"w": Run()}, folder / "bad.pt")
    with pytest.raises(untrusted.Unreadable, match="bad.pt .*names builtins.print"):
        untrusted.load_tensors(str(folder / "bad.pt"))


def test_a_training_checkpoint_loads_as_torch_load_gives_it(folder):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3, "seed": 2**40,
             "scale": torch.nn.Parameter(torch.ones(2)), "f8": torch.zeros(2, dtype=torch.float8_e4m3fn),
             "view": torch.arange(10)[2:5], "dtype": torch.bfloat16, "shape": torch.Size([2]), 7: b"raw"}
    torch.save(saved, folder / "ckpt.pt")
    got = untrusted.load_tensors(str(folder / "ckpt.pt"))
    expected = torch.load(folder / "ckpt.pt", weights_only=True)
    assert list(got) == list(expected) and type(got["model"]) is type(expected["model"])
    assert all(torch.equal(got["model"][k], v) for k, v in expected["model"].items())
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    assert type(got["scale"]) is torch.nn.Parameter and torch.equal(got["view"], torch.tensor([2, 3, 4]))
    assert (got["epoch"], got["seed"], got["dtype"], got["shape"], got[7]) == (3, 2**40, torch.bfloat16,
                                                                               torch.Size([2]), b"raw")


def _with_pickle(folder, name: str, pickle: bytes) -> str:
    """A checkpoint torch.save wrote, its data.pkl replaced by ``pickle``."""
    import zipfile

    torch.save({"w": torch.ones(2)}, folder / "base.pt")
    with zipfile.ZipFile(folder / "base.pt") as src, zipfile.ZipFile(folder / name, "w") as out:
        for record in src.infolist():
            out.writestr(record.filename, pickle if record.filename.endswith("/data.pkl") else src.read(record))
    return str(folder / name)


def test_a_checkpoint_that_asks_for_gigabytes_or_nests_without_end_is_refused_before_it_is_loaded(folder):
    """150 bytes of pickle that weights_only=True alone would turn into 3.38 GB (bytearray is on its
    allowlist), and a dict key nested a million deep (its hash() recurses in C)."""
    bomb = b"\x80\x02c__builtin__\nbytearray\nq\x00J\x00\x00\x78\xc9\x85q\x01Rq\x02."  # bytearray(3380000000)
    deep = b"\x80\x02}(K\x01" + b"\x85" * 1_000_000 + b"K\x02u."
    for name, pickle, why in (("bomb.pt", bomb, "builtins.bytearray"), ("deep.pt", deep, "nested more than 64")):
        with pytest.raises(untrusted.Unreadable, match=why):
            untrusted.load_tensors(_with_pickle(folder, name, pickle))


def test_a_checkpoint_whose_tensors_claim_more_than_the_file_is_refused(folder):
    import zipfile

    torch.save({"w": torch.zeros(1).expand(10**8)}, folder / "stride0.pt")  # eight bytes, 10^8 elements
    with pytest.raises(untrusted.Unreadable, match="strides repeat elements"):
        untrusted.load_tensors(str(folder / "stride0.pt"))
    torch.save({"w": torch.zeros(1000)}, folder / "plain.pt")
    with zipfile.ZipFile(folder / "plain.pt") as src, \
            zipfile.ZipFile(folder / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as out:
        for record in src.infolist():
            out.writestr(record.filename, src.read(record))
    with pytest.raises(untrusted.Unreadable, match="compressed record"):
        untrusted.load_tensors(str(folder / "deflated.pt"))


def test_json_lines_are_read_with_their_nesting_and_values_bounded(folder):
    from grader.rank import wire

    (folder / "log.jsonl").write_text('{"a": 1}\n' + "[" * 5000 + "]" * 5000 + '\n{"cut": \n[2]\n')
    assert untrusted.read_json_lines(str(folder / "log.jsonl")) == [{"a": 1}, [2]]  # too deep or cut: left out
    (folder / "many.jsonl").write_bytes(b"[" + b"0," * 600_000 + b"0]\n" + b"\n" * 1_000_000)
    assert len(untrusted.read_json_lines(str(folder / "many.jsonl"))[0]) == 600_001
    with pytest.raises(untrusted.Unreadable, match="values"):
        untrusted.read_json_lines(str(folder / "many.jsonl"), wire.Budget(values=100_000))


def test_a_submission_that_is_a_link_or_too_large_is_refused(tmp_path):
    real = tmp_path / "01_setup.py"
    real.write_text("x = 1\n")
    (tmp_path / "link.py").symlink_to(real)
    assert untrusted.read_submission(str(real)) == b"x = 1\n"
    with pytest.raises(untrusted.Unreadable, match="symbolic link"):
        untrusted.read_submission(str(tmp_path / "link.py"))
    with pytest.raises(untrusted.Unreadable, match="at most 3"):
        untrusted.read_submission(str(real), limit=3)


@pytest.mark.parametrize("raw, shown", [
    ("plain\ttext\n", "plain\ttext\n"),
    ("\x1b]52;c;ZWNobyBwd25lZA==\x07after", "after"),  # OSC 52: set the clipboard
    ("\x1b]0;title\x1b\\after", "after"),  # OSC ended by ST
    ("\x1b[2J\x1b[Hred\x1b[31m!\x1b[0m", "red!"),  # CSI
    ("\x9b31mC1", "C1"),  # 8-bit CSI
    ("\x1bP+q544e\x1b\\after", "after"),  # DCS
    ("bell\x07 and\r\nline", "bell and\nline"),
    ("lone\x1b", "lone"),
    ("cod\u202egnp.exe", "codgnp.exe"),  # right-to-left override: would show "codexe.png"
    ("\u202a\u202b\u202c\u202d|\u2066\u2067\u2068\u2069|x", "||x"),  # every embedding, override and isolate
    ("\u05e9\u05dc\u05d5\u05dd \u00e9 \u200d", "\u05e9\u05dc\u05d5\u05dd \u00e9 \u200d"),  # right-to-left letters stay
])
def test_control_sequences_are_removed_and_text_kept(raw, shown):
    assert untrusted.clean_text(raw) == shown


def test_one_line_stays_one_line():
    assert untrusted.clean_line("ev\x1b]0;x\x07il\nname\tx") == "evil name x"
    assert untrusted.clean_line("alice\u202e\nyp.puteS_10") == "alice yp.puteS_10"


# --- what comes out of a sandbox ---------------------------------------------------------------------------


def _rank(rank, **fields):
    return {"rank": rank, "status": "ok", "result": {"loss": 1.0}, "error": None, "exitcode": 0, "stack": "",
            "output": "", "seconds": 0.1, "limit": "", "limit_detail": "", **fields}


def _world(*ranks, **fields):
    return {"world_size": len(ranks), "ranks": list(ranks), "timed_out": False, "seconds": 1.0, "run_dir": "/x",
            "stray_processes": 0, "start_s": 99.0, **fields}


def test_a_well_formed_outcome_is_read_and_its_start_measured_by_the_grader():
    world = boundary.world_from(_world(_rank(0), _rank(1)), 2)
    assert [r.status for r in world.ranks] == ["ok", "ok"] and world.start_s == 0.0
    assert world.ranks[0].result == {"loss": 1.0}


@pytest.mark.parametrize("data, why", [
    (_world(_rank(0)), "of 1 ranks, expected 2"),
    (_world(_rank(0), _rank(0)), "not 0 to world size - 1"),
    (_world(_rank(0), _rank(1, status="bogus")), "status 'bogus'"),
    (_world(_rank(0), _rank(1, seconds=math.nan)), "not a finite number"),
    (_world(_rank(0), _rank(1, stack=b"bytes")), "where text was expected"),
    (_world(_rank(0), _rank(1), timed_out="yes"), "True or False"),
    (_world(_rank(0), _rank(1, exitcode="0")), "exit code"),
    (["not", "a", "mapping"], "not a mapping"),
])
def test_an_outcome_that_is_not_one_is_unreadable(data, why):
    with pytest.raises(boundary.Unreadable, match=why):
        boundary.world_from(data, 2)


def test_long_text_is_cut_and_unknown_error_fields_kept_only_when_plain():
    error = {"type": "RuntimeError", "message": "m" * 10_000, "traceback": "", "where": {"line": 3, "function": "f",
             "code": "x"}, "phase": "run", "at": 1.0, "rendezvous": {"port": "1"}}
    world = boundary.world_from(_world(_rank(0, status="error", error=error, output="o" * 50_000), _rank(1)), 2)
    rank = world.ranks[0]
    assert len(rank.error["message"]) == 4000 and len(rank.output) == boundary.MAX_TEXT
    assert rank.error["where"] == {"line": 3, "function": "f", "code": "x"} and rank.error["rendezvous"] == {"port": "1"}


def test_a_report_with_an_unknown_status_is_not_a_report():
    good = Report("01", "t", "p", "passed").to_dict()
    assert report_from_dict(good).status == "passed"
    for bad in ({**good, "status": "bogus"},
                {**good, "checks": [{"id": "a", "title": "a", "status": "bogus"}]},
                {**good, "exercise": 1},
                {"status": "passed"}):
        with pytest.raises(ValueError, match="not a report"):
            report_from_dict(bad)


def test_every_value_of_a_report_is_json_whatever_a_rank_put_in_its_evidence():
    """Bytes and sets in a rank's error details (a rendezvous at a bytes address) are text in the report,
    in its JSON and in its words; nothing of the submission's own classes runs."""
    import json

    from grader import report as render
    from grader.results import STUCK_RENDEZVOUS, RunProblem

    class Loud(str):
        def __str__(self):
            raise AssertionError("the submission's own __str__ ran")

    evidence = {"addr": b"\xff\x00host", "port": {29501, 29500}, "waited_s": b"7", "grader_port": math.nan,
                "big": 10**5000, 7: (frozenset({b"a"}),), Loud("k"): Loud("v"), "deep": [[[[[[[]]]]]]] * 2}
    problem = RunProblem(STUCK_RENDEZVOUS, "failed", rank=1, world_size=2, evidence=evidence)
    report = Report("01", "t", "p", "failed", run_problem=problem)
    data = json.loads(render.render_json(report))
    shown = data["run_problem"]["evidence"]
    assert shown["addr"] == "b'\\xff\\x00host'" and shown["port"] == "{29500, 29501}"
    assert shown["grader_port"] == "nan" and shown["big"].startswith("<an integer of") and shown["k"] == "v"
    assert shown["7"] == ["{b'a'}"]
    assert "waited b'7' s" in data["problem"] and "waited b'7' s" in render.render_text(report)
    assert report_from_dict(report.to_dict()).run_problem.evidence == shown
