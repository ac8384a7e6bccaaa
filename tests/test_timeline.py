"""What each rank did over time: read from the ranks' own records as untrusted data, drawn in the text
report (80 columns, no colour), written as a Chrome trace and as one HTML page (read back in headless
Chromium), and a wrong answer's events differing from the reference's."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, VARIANTS
from grader import timeline as T
from grader import timeline_view as V
from grader.results import Report


def _event(kind, t0, t1, **info):
    return {"kind": kind, "op": info.pop("op", kind), "t0": t0, "t1": t1, **info}


def hand_made(ranks: int = 2, shown: bool = True) -> dict:
    """A run of ``ranks`` ranks as the ranks would send it: a forward, a send to the next rank, a backward."""
    records = []
    for r in range(ranks):
        base = 100.0 + r * 0.001
        records.append({"events": [
            _event("region", base, base + 0.05, label="the step"),
            _event("forward", base + 0.001, base + 0.01, label="F0"),
            _event("send", base + 0.01, base + 0.012, op="isend", bytes=1024, peer=(r + 1) % ranks, **{"async": True}),
            _event("recv", base + 0.012, base + 0.02, bytes=1024, peer=(r - 1) % ranks),
            _event("backward", base + 0.02, base + 0.04, label="B0"),
            _event("collective", base + 0.04, base + 0.045, op="all_reduce", bytes=4096),
        ], "dropped": 0})
    return T.from_ranks(records, label="a hand-made run", world_size=ranks, window=(99.0, 101.0), shown=shown)


def report_with(runs: list[dict], **fields) -> Report:
    sections = [{"title": f"what each rank did over time: {run['label']}", "text": T.summary(run), "data": {T.KEY: run}}
                for run in runs]
    return Report(fields.pop("exercise", "13"), "A pipeline", "solutions/13_pipeline.py", "passed",
                  sections=sections, **fields)


# --- untrusted records ------------------------------------------------------------------------------------


def test_a_rank_may_send_anything_and_only_well_formed_events_in_the_run_window_are_kept():
    good = _event("send", 100.0, 100.5, op="isend", bytes=64, peer=1, label="F\x1b]52;c;aGk=\x07 <b>\u202e")
    records = [
        {"events": [good, "not a dict", None, 7,
                    _event("send", math.nan, 100.1), _event("send", 100.0, math.inf), _event("send", True, 100.1),
                    _event("send", 100.2, 100.1),  # ends before it starts
                    _event("teleport", 100.0, 100.1),  # no such kind
                    _event("send", 5.0, 6.0),  # long before the run began
                    _event("recv", 100.0, 100.1, bytes=-5, peer=2**40, thread="main", label=["x"]),
                    ], "dropped": 3},
        {"events": "all of them"},
        ["not", "a", "record"],
        {"events": [_event("forward", 100.0, 100.0001)] * (T.MAX_EVENTS + 10)},
    ]
    run = T.from_ranks(records, label="r\x1b[31m", world_size=4, window=(99.5, 101.0))
    first = run["ranks"][0]
    assert [e["op"] for e in first["events"]] == ["isend", "recv"]
    assert first["events"][0]["label"].isprintable() and "\x1b" not in first["events"][0]["label"]
    assert set(first["events"][0]["label"]) <= {chr(c) for c in range(32, 127)}
    assert "bytes" not in first["events"][1] and "peer" not in first["events"][1] and "thread" not in first["events"][1]
    assert first["dropped"] == 9 + 3  # nine events left out, three the rank itself could not keep
    assert [r["problem"] != "" for r in run["ranks"]] == [False, True, True, False]
    assert len(run["ranks"][3]["events"]) == T.MAX_EVENTS and run["ranks"][3]["dropped"] == 10
    assert run["label"] == "r?[31m" and run["origin"] == 100.0 and run["ranks"][0]["events"][0]["t0"] == 0.0


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=6),
                           max_leaves=40)
event_like = st.fixed_dictionaries({"kind": st.sampled_from(T.KINDS) | st.text(max_size=5),
                                    "t0": st.floats() | st.integers() | json_values,
                                    "t1": st.floats() | st.integers() | json_values},
                                   optional={"op": json_values, "label": json_values, "bytes": json_values,
                                             "peer": json_values, "thread": json_values, "async": json_values})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(json_values, st.fixed_dictionaries({"events": st.lists(event_like | json_values,
                                                                                  max_size=8)})), max_size=4),
       json_values)
def test_nothing_a_rank_sends_makes_the_timeline_or_its_drawings_fail(records, section):
    run = T.from_ranks(records, label="fuzz", world_size=len(records), window=None, shown=True)
    assert T.read_run(run) is not None
    report = report_with([run])
    data = report.to_dict()
    data["sections"].append({"title": "x", "text": "", "data": {T.KEY: section}})  # whatever a report may hold
    for s in data["sections"]:
        V.section_text(s, verbose=True)
    for width in (80, 40):
        assert all(len(line) <= width for line in V.text(run, width).splitlines())
    json.loads(V.trace_json(T.runs_in(data["sections"]), data))
    V.html_page(T.runs_in(data["sections"]), data)


def test_a_malformed_report_section_is_not_drawn_and_never_fails():
    for data in (None, 3, [], {"version": 2, "ranks": []}, {"version": 1, "ranks": "x"}):
        assert T.read_run(data) is None
        assert V.section_text({"title": "t", "text": "", "data": {T.KEY: data}}, verbose=True) == ""
    odd = {"version": 1, "ranks": [{"events": [{"kind": "send", "t0": "a"}]}, "x"], "world_size": "many"}
    assert T.read_run(odd)["ranks"] == [{"rank": 0, "events": [], "dropped": 1, "problem": ""}]
    assert "rank 0: 1 event not shown" in V.section_text({"data": {T.KEY: odd}}, verbose=True)


# --- drawn -----------------------------------------------------------------------------------------------


def test_the_text_drawing_fits_80_columns_without_colour_and_shows_where_asked():
    from grader.report import render_text

    run = hand_made(4)
    drawing = V.text(run)
    lines = drawing.splitlines()
    assert max(len(line) for line in lines) <= 80 and "\x1b" not in drawing
    assert sum(bool(re.match(r"  rank \d+ \|", line)) for line in lines) == 4  # one lane per rank
    lane = next(line for line in lines if line.startswith("  rank 0 |"))
    assert lane.index("F") < lane.index("B")  # time across: the forward before the backward
    communication = lines[lines.index(lane) + 1]
    assert communication.index(">") < communication.index("<") < communication.index("C")
    assert "rank 0: 1 forward, 1 backward | to 1: 1 msg 1.0 KiB | from 3: 1 msg 1.0 KiB" in drawing
    shown = render_text(report_with([run]))
    assert "  rank 0 |" in shown and max(len(line) for line in shown.splitlines()) <= 80
    hidden = report_with([hand_made(2, shown=False)])
    assert "  rank 0 |" not in render_text(hidden) and "  rank 0 |" in render_text(hidden, verbose=True)


def test_the_html_page_escapes_what_a_rank_named_and_fetches_nothing():
    records = [{"events": [_event("forward", 100.0, 100.1, label="</script><script>alert(1)</script>")]}]
    run = T.from_ranks(records, label="<img src=x onerror=alert(1)>", world_size=1, window=None)
    report = report_with([run]).to_dict()
    report["checks"] = [{"id": "grads-match", "status": "fail", "title": "t",
                         "message": "rank 0 raised <img src=x onerror=alert(2)>"}]
    page = V.html_page(T.runs_in(report["sections"]), report)
    assert "<script>alert" not in page and "<img src=x" not in page
    assert "&lt;img src=x onerror=alert(2)&gt;" in page
    assert page.count("<script") == 2  # the data and the drawing code, nothing else
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert "default-src 'none'" in page


def test_grade_with_trace_writes_the_json_or_the_page_and_exit_2_when_it_cannot(tmp_path, monkeypatch):
    from grader import cli, flow

    monkeypatch.setenv("DDP_GRADE_STATE_DIR", str(tmp_path / "state"))
    report = report_with([hand_made(2)])
    monkeypatch.setattr(flow, "in_a_pool_of_its_own", lambda *args, **kwargs: flow.Graded(report))
    run = CliRunner().invoke

    def grade(*args):
        return run(cli.main, [str(ROOT / "solutions" / "13_pipeline.py"), "--no-server", *args], catch_exceptions=False)

    result = grade("--trace", str(tmp_path / "t.json"))
    assert result.exit_code == 0
    trace = json.loads((tmp_path / "t.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    said = [ln for ln in result.output.splitlines() if str(tmp_path / "t.json") in ln]
    assert len(said) == 1 and "Perfetto" in said[0] and "1 run" in said[0]
    result = grade("--trace", str(tmp_path / "t.html"))
    assert result.exit_code == 0
    assert (tmp_path / "t.html").read_text().startswith("<!doctype html>")
    said = [ln for ln in result.output.splitlines() if str(tmp_path / "t.html") in ln]
    assert len(said) == 1 and "browser" in said[0] and (tmp_path / "t.html").as_uri() in said[0]
    result = grade("--trace", str(tmp_path / "missing" / "t.json"))
    assert result.exit_code == 2 and "cannot write" in result.output and "Traceback" not in result.output


def test_the_graders_own_calls_are_marked_apart_in_the_text_the_trace_and_the_page_and_not_counted():
    records = hand_made(2)["ranks"]
    raw = []
    for r in records:
        events = [dict(e, t0=e["t0"] + 100.0, t1=e["t1"] + 100.0) for e in r["events"]]
        events.append(_event("collective", 100.046, 100.047, op="all_reduce", bytes=4, by="grader"))
        events.append(_event("collective", 100.047, 100.048, op="barrier", by="someone else"))  # only "grader" marks
        raw.append({"events": events})
    run = T.from_ranks(raw, label="with the grader's", world_size=2, window=(99.0, 101.0), shown=True)
    mine = [e for e in run["ranks"][0]["events"] if e.get("by") == "grader"]
    assert [e["op"] for e in mine] == ["all_reduce"]
    drawing = V.text(run)
    assert "all_reduce x1 4.0 KiB" in drawing and "all_reduce x2" not in drawing  # the learner's one, alone
    assert "the grader's own, not counted: all_reduce x1" in drawing and "barrier x1" in drawing
    lines = drawing.splitlines()
    communication = lines[lines.index(next(ln for ln in lines if ln.startswith("  rank 0 |"))) + 1]
    assert "g" in communication and "C" in communication
    assert "4 collectives" in T.summary(run)  # 2 ranks x (the learner's all_reduce and the unmarked barrier)
    trace = V.chrome_trace([run])
    graders = [e for e in trace["traceEvents"] if e.get("cat") == "grader"]
    assert len(graders) == 2 and all(e["args"]["by"] == "grader" and e["name"].startswith("grader: ") for e in graders)
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {tracks[(e["pid"], e["tid"])] for e in graders} == {V.GRADER_TRACK}
    page = V.html_page([run], {})
    assert '"by": "grader"' in page and "the grader&#x27;s own calls (not yours)" in page


def test_a_stopped_run_is_read_from_what_the_ranks_flushed_bounded_and_its_open_calls_marked(tmp_path):
    rank0 = [{"kind": "forward", "op": "forward", "t0": 100.0, "t1": 100.01, "label": "F0"},
             {"kind": "send", "op": "send", "t0": 100.01, "t1": 100.01, "peer": 1, "bytes": 64, "open": True, "call": 1},
             {"kind": "send", "op": "send", "t0": 100.01, "t1": 100.02, "peer": 1, "bytes": 64, "call": 1},
             {"kind": "recv", "op": "recv", "t0": 100.02, "t1": 100.02, "peer": 1, "bytes": 64, "open": True, "call": 2}]
    (tmp_path / "rank0.timeline").write_bytes(
        b"\n".join(json.dumps(e).encode() for e in rank0) + b"\nnot json\n[1, 2]\n" + b"{" * 5000 + b"\n")
    (tmp_path / "rank1.timeline").symlink_to("/dev/zero")  # a link is not followed
    os.mkfifo(tmp_path / "rank2.timeline")  # nor is a pipe waited on
    run = T.stopped_run(str(tmp_path), 4, label="world size 4, timed out", window=(99.0, 100.5), problem="timed out")
    assert run["stopped"] is True and run["problem"] == "timed out"
    first = run["ranks"][0]
    assert [(e["kind"], e.get("open", False)) for e in first["events"]] == [
        ("forward", False), ("send", False), ("recv", True)]
    # "[1, 2]" is counted; a line that is not JSON, or nests too deep, is left out (a line a kill cut short)
    assert first["events"][-1]["t1"] == pytest.approx(0.5) and first["dropped"] == 1
    assert [r["problem"] for r in run["ranks"][1:]] == ["no timeline came back from this rank"] * 3
    assert T.read_run(run)["stopped"] is True
    drawing = V.text(run)
    assert "still in recv from 1 when the run stopped" in drawing
    page = V.html_page([run], {"problem": "Timed out: rank 0 waits in recv from rank 1", "sections": []})
    assert '<div id="problem"><pre>Timed out: rank 0 waits in recv from rank 1</pre></div>' in page
    assert V.chrome_trace([run], {"problem": "Timed out"})["otherData"]["problem"] == "Timed out"
    assert T.stopped_run(str(tmp_path / "none"), 2, label="x", window=(0.0, 1.0)) is None


def test_a_slot_view_is_read_bounded_and_the_page_holds_it_with_its_section_text():
    view = T.slot_view([["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]], [[0, 1, 3, 5], [1, 2, 3, 4]],
                       notes=["peak: 2", "peak: 1"], caption="unit slots")
    assert view["rows"][0]["cells"] == ["F0", "F1", "", "B0", "", "B1"]
    assert view["rows"][1]["cells"] == ["", "F0", "B0", "F1", "B1", ""]
    assert T.read_slot_view(view) == view
    hostile = {"rows": [{"name": "<b>", "cells": ["x" * 100] * (T.MAX_SLOTS + 5), "note": 3}, "x"], "caption": None}
    read = T.read_slot_view(hostile)
    assert len(read["rows"]) == 1 and len(read["rows"][0]["cells"]) == T.MAX_SLOTS
    assert all(len(c) <= T.MAX_CELL for c in read["rows"][0]["cells"])
    for bad in (None, 3, {"rows": "x"}, {"rows": []}):
        assert T.read_slot_view(bad) is None
    report = {"sections": [{"title": "the 1f1b schedule as each rank ran it", "text": "idle: 25% </pre><b>",
                            "data": {T.SLOT_KEY: view}}]}
    page = V.html_page([], report)
    assert '"kind": "slots"' in page and "the 1f1b schedule as each rank ran it" in page and "</pre><b>" not in page


# --- real gradings --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graded(session):
    """Reports of the references and of the three wrong answers, graded once (world size 2 and the odd one)."""
    from grader.grading import GradeOptions, grade_file

    files = {"13": ROOT / "solutions" / "13_pipeline.py", "13-gpipe": VARIANTS / "13_1f1b_runs_gpipe.py",
             "08": ROOT / "solutions" / "08_bucketed.py", "08-after": VARIANTS / "08_sync_after_backward.py",
             "16": ROOT / "solutions" / "16_ring_attention.py", "16-gather": VARIANTS / "16_all_gather_kv.py"}
    graded = {key: grade_file(str(path), session, GradeOptions(world_size=2, timeout_s=120))
              for key, path in files.items()}
    # A 1F1B whose blocking sends deadlock: gpipe passes, then the grader stops the hung run at its deadline.
    graded["13-hung"] = grade_file(str(VARIANTS / "13_1f1b_blocking_sends.py"), session,
                                   GradeOptions(world_size=2, timeout_s=15))
    return graded


def _run(report, label: str) -> dict:
    return next(run for run in T.runs_in([dict(s) for s in report.sections]) if run["label"] == label)


@pytest.mark.slow
def test_the_trace_of_13_holds_every_event_of_the_record_one_process_per_rank_one_track_per_kind(graded, tmp_path):
    report = graded["13"].to_dict()
    path = tmp_path / "t.json"
    assert V.write(str(path), report) == 4  # gpipe and 1f1b, world sizes 2 and 3
    trace = json.loads(path.read_text())
    runs = T.runs_in(report["sections"])
    base = min(run["origin"] for run in runs)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for index, run in enumerate(runs):
        for r in run["ranks"]:
            pid = index * 1000 + r["rank"]
            assert processes[pid] == f"rank {r['rank']}: {run['label']}"
            mine = sorted((e for e in slices if e["pid"] == pid), key=lambda e: (e["ts"], -e["dur"]))
            assert len(mine) == len(r["events"]) and r["events"]
            for e, s in zip(r["events"], mine):
                assert s["cat"] == e["kind"] and names[(pid, s["tid"])] == T.TRACKS[e["kind"]]
                assert s["ts"] == pytest.approx((run["origin"] - base + e["t0"]) * 1e6, abs=0.01)
                assert s["dur"] == pytest.approx((e["t1"] - e["t0"]) * 1e6, abs=0.01)
                assert s["args"].get("peer") == e.get("peer") and s["args"].get("bytes") == e.get("bytes")
    # The timeline agrees with the other record of the same run: the order each stage ran its forwards and
    # backwards, as the stage saw them (13's schedule section).
    schedules = {s["data"]["schedule"]: s["data"]["runs"] for s in report["sections"] if "schedule" in s["data"]}
    for run in runs:
        schedule, world_size = run["label"].split(", world size ")
        order = next(o for o in schedules[schedule] if o["world_size"] == int(world_size))["order"]
        step = T.regions(run)[0]["label"]
        for r in run["ranks"]:
            ran = [e["label"] for e in T.events(run, r["rank"], ("forward", "backward"), within=step)]
            assert ran == order[r["rank"]]
    assert trace["otherData"]["checks"] and all(c["status"] == "pass" for c in trace["otherData"]["checks"])


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
                 if shutil.which(n)), None)


class _Lanes(HTMLParser):
    """The drawn lanes of a page's DOM: {(run, rank): [(kind, label), ...]}, the checks listed, the slot rows of
    each schedule's table, the region names drawn, the calls marked still open, the problem at the top."""

    def __init__(self):
        super().__init__()
        self.lanes: dict = {}
        self.checks: list = []
        self.slot_rows: dict = {}
        self.regions: list = []
        self.region_buttons: list = []
        self.open: dict = {}
        self.problem = ""
        self._lane = None
        self._depth = 0
        self._heading = ""
        self._text = None  # where the text now read goes
        self._cell = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "g" and a.get("class") == "lane":
            self._lane = (int(a["data-run"]), int(a["data-rank"]))
            self.lanes[self._lane], self.open[self._lane], self._depth = [], [], 0
        elif tag == "g" and self._lane is not None:
            self._depth += 1
        elif tag == "rect" and self._lane is not None and a.get("data-kind"):
            self.lanes[self._lane].append((a["data-kind"], a.get("data-label", "")))
            if a.get("data-open") == "true":
                self.open[self._lane].append(a["data-kind"])
        elif tag == "li" and "data-check" in a:
            self.checks.append((a["data-check"], a.get("class")))
        elif tag == "h2":
            self._heading, self._text = "", "heading"
        elif tag == "tr" and a.get("class") == "slot-row":
            schedule = self._heading.split()[1] if self._heading.startswith("the ") else self._heading
            self.slot_rows.setdefault(schedule, []).append([])
        elif tag == "td" and self.slot_rows and "note" not in (a.get("class") or ""):
            self._cell = True
        elif tag == "text" and a.get("class") == "region-name":
            self.regions.append(a.get("data-region"))
        elif tag == "button" and a.get("data-region"):
            self.region_buttons.append(a["data-region"])
        elif tag == "div" and a.get("id") == "problem":
            self._text = "problem"

    def handle_data(self, data):
        if self._text == "heading":
            self._heading += data
        elif self._text == "problem":
            self.problem += data
        if self._cell:
            row = next(reversed(self.slot_rows.values()))[-1]
            row.append(data.strip())
            self._cell = False

    def handle_endtag(self, tag):
        if tag == "g" and self._lane is not None:
            if self._depth:
                self._depth -= 1
            else:
                self._lane = None
        elif tag in ("h2", "div"):
            self._text = None


def _browse(page, tmp_path) -> str:
    """The DOM of ``page`` once headless Chromium has run its script."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium here (Debian: apt-get install chromium)")
    profile = tmp_path / f"profile-{page.stem}"
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--disable-sync", "--no-first-run",
                          f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout


def _report_data(report) -> dict:
    """What `ddp-grade --trace` writes from: the report's data and its problem in the terminal's words."""
    from grader.report import problem_of

    return {**report.to_dict(), "problem": problem_of(report) or ""}


@pytest.mark.slow
def test_the_page_of_13_opened_in_headless_chromium_draws_every_lane_the_slot_rows_and_the_region_names(
        graded, tmp_path):
    report = _report_data(graded["13"])
    page = tmp_path / "t.html"
    V.write(str(page), report)
    dom = _browse(page, tmp_path)
    found = _Lanes()
    found.feed(dom)
    runs = T.runs_in(report["sections"])
    assert 'data-drawn="4"' in dom and len(found.lanes) == sum(len(run["ranks"]) for run in runs)
    for index, run in enumerate(runs):
        for r in run["ranks"]:
            assert found.lanes[(index, r["rank"])] == [(e["kind"], e.get("label", "")) for e in r["events"]]
    assert found.checks == [(c["id"], c["status"]) for c in report["checks"]]
    # The schedule as the text report draws it: one row of slots per rank, F0 F1 ... in the cells.
    for schedule in ("gpipe", "1f1b"):
        section = next(s for s in report["sections"] if s["title"] == f"the {schedule} schedule as each rank ran it")
        written = [ln.split()[2:] for ln in section["text"].splitlines() if ln.startswith("  rank ")]
        written = [cells[:cells.index("(peak:")] for cells in written]
        assert found.slot_rows[schedule] == written and len(written) == max(run["world_size"] for run in runs)
        assert found.slot_rows[schedule][0][:2] == ["F0", "F1"]
    # Each region's name drawn on the lanes (not only in a hover title), and a button to view it alone.
    names = {p["label"] for run in runs for p in T.regions(run)}
    assert names and names <= set(found.regions) and names <= set(found.region_buttons)
    assert "the step of 4 micro-batches" in names


@pytest.mark.slow
def test_a_deadlocking_13_writes_a_page_holding_its_hung_runs_lanes_and_the_problem(graded, tmp_path):
    report = _report_data(graded["13-hung"])
    assert report["status"] == "timeout" and "timed out" in report["problem"].lower()
    hung = [run for run in T.runs_in(report["sections"]) if run.get("stopped")]
    assert [run["label"] for run in hung] == ["world size 2, timed out"]
    open_calls = {r["rank"]: [e for e in r["events"] if e.get("open")] for r in hung[0]["ranks"]}
    assert all(open_calls[rank] and open_calls[rank][-1]["kind"] in ("send", "recv") for rank in (0, 1)), open_calls
    assert any(e["kind"] == "forward" for r in hung[0]["ranks"] for e in r["events"])  # its lanes up to the stop
    page = tmp_path / "hung.html"
    V.write(str(page), report)
    dom = _browse(page, tmp_path)
    found = _Lanes()
    found.feed(dom)
    assert found.problem.strip() == report["problem"].strip() and "timed out" in found.problem.lower()
    index = T.runs_in(report["sections"]).index(hung[0])
    assert {rank for (run, rank), marks in found.open.items() if run == index and marks} == {0, 1}
    trace = json.loads(V.trace_json(T.runs_in(report["sections"]), report))
    assert "timed out" in trace["otherData"]["problem"].lower()
    assert "still in " in V.text(hung[0])  # -v prints the same lanes, each rank's last call named


@pytest.mark.slow
def test_13_with_gpipe_where_1f1b_was_asked_runs_every_forward_before_a_backward_unlike_the_reference(graded):
    first_backward = {}
    for key in ("13", "13-gpipe"):
        run = _run(graded[key], "1f1b, world size 2")
        step = "the step of 4 micro-batches"
        for rank in (0, 1):
            ran = [e["label"] for e in T.events(run, rank, ("forward", "backward"), within=step)]
            assert sorted(ran) == ["B0", "B1", "B2", "B3", "F0", "F1", "F2", "F3"], (key, rank, ran)
            first_backward[key, rank] = ran.index("B0")
    # 1F1B: rank r starts backward after W - r forwards; GPipe runs all M = 4 first, on every rank.
    assert [first_backward["13", r] for r in (0, 1)] == [2, 1]
    assert [first_backward["13-gpipe", r] for r in (0, 1)] == [4, 4]


@pytest.mark.slow
def test_08_all_reduces_during_backward_and_the_variant_only_after_it(graded):
    for key, overlaps in (("08", True), ("08-after", False)):
        run = _run(graded[key], "world size 2")
        steps = "float32, 3 training steps"
        for rank in (0, 1):
            backwards = T.events(run, rank, ("backward",), within=steps)
            reduces = [e for e in T.events(run, rank, ("collective",), within=steps) if e["op"] == "all_reduce"]
            assert len(backwards) == 3 and reduces
            during = [e for e in reduces if any(b["t0"] <= e["t0"] <= b["t1"] for b in backwards)]
            assert bool(during) == overlaps, (key, rank)
            assert all(e.get("async") for e in during)


@pytest.mark.slow
def test_16_passes_blocks_around_the_ring_and_the_variant_gathers_every_block(graded):
    for key in ("16", "16-gather"):
        run = _run(graded[key], "world size 3")
        plain = "plain"
        for rank in range(3):
            gathers = [e for e in T.events(run, rank, ("collective",), within=plain) if "gather" in e["op"]]
            messages = T.events(run, rank, ("send", "recv"), within=plain)
            if key == "16":
                assert not gathers and messages
                assert {e["peer"] for e in messages if e["kind"] == "send"} == {(rank + 1) % 3}
                assert {e["peer"] for e in messages if e["kind"] == "recv"} == {(rank - 1) % 3}
            else:
                assert gathers and not messages


@pytest.mark.slow
def test_33_a_blocking_save_shows_no_write_going_on_while_training_does(grade):
    """The reference's picture (tests/test_exercises.py: its save returns and the checkpoint's collectives go
    on in another thread while the job trains) is not the picture of dcp.save, which returns when written."""
    from test_exercises import _saves_write_while_training_goes_on

    report = grade(VARIANTS / "33_blocking_save.py")
    runs = [run for run in T.runs_in([dict(s) for s in report.sections]) if run["label"].startswith("the save job")]
    assert runs
    for rank in range(runs[0]["world_size"]):
        with pytest.raises(AssertionError):
            _saves_write_while_training_goes_on(runs[0], rank)


@pytest.mark.slow
def test_37s_trace_and_page_mark_the_graders_all_reduce_after_each_push_apart_from_the_learners_messages(grade):
    report = grade(ROOT / "solutions" / "37_weight_sync.py")
    data = report.to_dict()
    runs = T.runs_in(data["sections"])
    slices = [e for e in V.chrome_trace(runs, data)["traceEvents"] if e.get("ph") == "X"]
    graders = [e for e in slices if e["cat"] == "grader"]
    assert graders and {e["args"]["op"] for e in graders} == {"all_reduce"}
    assert [e for e in slices if e["cat"] == "collective"] == []  # the push itself: sends and receives only
    assert any(e["cat"] in ("send", "recv") for e in slices)
    for run in runs:
        for r in run["ranks"]:
            counted = V._counted(r["events"])
            assert "all_reduce x" not in counted.split("the grader's own")[0]


@pytest.mark.slow
def test_20s_lanes_name_each_case_as_the_checks_do_and_its_v_counts_no_all_reduce_of_the_graders(grade):
    from grader.report import render_text

    report = grade(ROOT / "solutions" / "20_ulysses.py")
    runs = T.runs_in([dict(s) for s in report.sections])
    names = {p["label"] for run in runs for p in T.regions(run)}
    for case in ("plain", "causal", "gqa", "few-kv"):  # the scenarios, with the heads the checks' messages give
        assert any(re.fullmatch(case + r": \d+ heads, \d+ kv(, causal)?", n) for n in names), (case, names)
    assert any(e.get("by") == "grader" for run in runs for r in run["ranks"] for e in r["events"])
    verbose = render_text(report, verbose=True)
    counted = [ln for ln in verbose.splitlines() if ln.strip().startswith("rank ") and ":" in ln]
    assert counted and not any("all_reduce x" in ln.split("the grader's own")[0] for ln in counted)
