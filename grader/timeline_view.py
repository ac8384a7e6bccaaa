"""Timelines drawn: in the text report (80 columns, no colour), as a Chrome trace (JSON, the format
``torch.profiler`` exports: Perfetto and chrome://tracing open it) and as one HTML page that needs
no network, with the check verdicts beside the lanes.

Every run comes from :func:`grader.timeline.runs_in` or :func:`grader.timeline.read_run`, which
check the data again; what a rank named (a label, a module's class) is escaped where it lands:
HTML-escaped in the page, ``json.dumps`` in the trace and in the page's data.
"""

from __future__ import annotations

import html
import json

from grader import timeline as T

WIDTH = 80
SYMBOLS = {"forward": "F", "backward": "B", "step": "O", "save": "S",
           "collective": "C", "send": ">", "recv": "<", "wait": "w"}
LEGEND = "F forward B backward O step S save | C collective > send < recv w wait"
LANE_PREFIX = 9  # "  rank 0 "
NUDGE = 2  # columns a phase may move right to stay apart from the one before it
_IDLE = {0: ".", 1: " "}  # compute row, communication row


# --- text -----------------------------------------------------------------------------------------------


def text(run: dict, width: int = WIDTH, every_region: bool = False) -> str:
    """The run drawn for a terminal: per region (or the whole run), one lane of two rows per rank (what it
    computed; what it sent, received and waited for), time across, and under it what each rank did there,
    counted; then the legend. No line is longer than ``width``."""
    lines = []
    for part in _parts(run, every_region):
        lines += _drawing(run, part, width)
    lines.append(LEGEND[:width])
    return "\n".join(lines)


def _parts(run: dict, every_region: bool) -> list[dict]:
    found = T.regions(run)
    if found and run["draw"] and not every_region:
        found = [p for p in found if p["label"] in run["draw"]] or found
    return found or [{"label": "", "t0": 0.0, "t1": run["span"]}]


def _inside(run: dict, r: dict, part: dict) -> list[dict]:
    """Rank ``r``'s events in ``part``: within its own mark of the region where it made one."""
    t0, t1 = T.region_of(run, r, part["label"]) if part["label"] else (part["t0"], part["t1"])
    return [e for e in r["events"] if e["kind"] in SYMBOLS and e["t1"] >= t0 and e["t0"] <= t1]


def _drawing(run: dict, part: dict, width: int) -> list[str]:
    columns = max(10, width - LANE_PREFIX - 2)
    length = max(part["t1"] - part["t0"], 1e-9)
    name = ": ".join(x for x in (run["label"], part["label"]) if x) or "the run"
    lines = [_fit(f"{name}: {_seconds(length)}, {_seconds(length / columns)} a column", width)]
    counted = []
    for r in run["ranks"]:
        rows = [[_IDLE[0]] * columns, [_IDLE[1]] * columns]
        inside = _inside(run, r, part)

        def place(e):
            first = int((max(e["t0"], part["t0"]) - part["t0"]) / length * columns)
            last = int((min(e["t1"], part["t1"]) - part["t0"]) / length * columns - 1e-9)
            first = max(0, min(first, columns - 1))
            return first, max(first, min(last, columns - 1))

        # What ran: in order of start, an event that lands on a column taken by the one before moves right by up to
        # NUDGE columns, so that phases shorter than a column keep their order (F0 B0 F1 rather than one letter).
        cursor = -1
        for e in sorted((e for e in inside if e["kind"] in T.PHASES), key=lambda e: e["t0"]):
            first, last = place(e)
            if first <= cursor < min(first + NUDGE, columns - 1):
                first, last = cursor + 1, max(last, cursor + 1)
            for c in range(first, last + 1):
                rows[0][c] = SYMBOLS[e["kind"]]
            cursor = max(cursor, last)
        # What it sent, received and waited for: longest first, so that a short message stays visible.
        for e in sorted((e for e in inside if e["kind"] not in T.PHASES), key=lambda e: e["t0"] - e["t1"]):
            first, last = place(e)
            for c in range(first, last + 1):
                rows[1][c] = SYMBOLS[e["kind"]]
        lane = f"  rank {r['rank']}"[:LANE_PREFIX].ljust(LANE_PREFIX)
        lines.append(_fit(lane + "|" + "".join(rows[0]) + "|", width))
        lines.append(_fit(" " * LANE_PREFIX + "|" + "".join(rows[1]) + "|", width))
        counted += _wrap(f"  rank {r['rank']}: " + _counted(inside, r["dropped"], r["problem"]), width)
    return lines + counted


def _counted(events: list[dict], dropped: int = 0, problem: str = "") -> str:
    """"4 forwards, 4 backwards | to 1: 4 x 1.0 KiB | from 1: 4 x 1.0 KiB | all_reduce x3 3.1 KiB | 4 waits"."""
    counts: dict[str, int] = {}
    for e in events:
        counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    parts = [", ".join(f"{counts[k]} {w}{'' if counts[k] == 1 else 's'}" for k, w in (
        ("forward", "forward"), ("backward", "backward"), ("step", "step"), ("save", "save")) if counts.get(k))]
    for kind, to in (("send", "to"), ("recv", "from")):
        by_peer: dict = {}
        for e in events:
            if e["kind"] == kind:
                n, size = by_peer.get(e.get("peer"), (0, 0))
                by_peer[e.get("peer")] = (n + 1, size + e.get("bytes", 0))
        for peer, (n, size) in sorted(by_peer.items(), key=lambda item: (item[0] is None, item[0] or 0)):
            parts.append(f"{to} {'any rank' if peer is None else peer}: {n} msg{'' if n == 1 else 's'} {_size(size)}")
    ops: dict[str, tuple[int, int]] = {}
    for e in events:
        if e["kind"] == "collective":
            n, size = ops.get(e["op"], (0, 0))
            ops[e["op"]] = (n + 1, size + e.get("bytes", 0))
    parts += [f"{op} x{n} {_size(size)}" for op, (n, size) in ops.items()]
    if counts.get("wait"):
        parts.append(f"{counts['wait']} wait{'' if counts['wait'] == 1 else 's'}")
    if dropped:
        parts.append(f"{dropped} event{'' if dropped == 1 else 's'} not shown")
    if problem:
        parts.append(problem)
    return " | ".join(p for p in parts if p) or "nothing recorded"


def _wrap(line: str, width: int) -> list[str]:
    """``line`` over as many lines as it takes, broken between its " | " parts (a part too long is cut)."""
    parts = line.split(" | ")
    lines, current = [], parts[0]
    for part in parts[1:]:
        if len(current) + 3 + len(part) <= width:
            current += " | " + part
        else:
            lines.append(_fit(current, width))
            current = "      " + part
    lines.append(_fit(current, width))
    return lines


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1000:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _fit(line: str, width: int) -> str:
    return line if len(line) <= width else line[:width - 3] + "..."


def section_text(section: dict, verbose: bool = False, width: int = WIDTH) -> str:
    """What the text report shows for a timeline section: the drawing when ``verbose`` or when the run asks
    to be shown (every region under ``verbose``), else "" (nothing)."""
    run = T.read_run(section.get("data", {}).get(T.KEY)) if isinstance(section, dict) else None
    if run is None or not (verbose or run["shown"]):
        return ""
    try:
        return text(run, width, every_region=verbose)
    except Exception:  # a drawing must never stop the report
        return "(this timeline could not be drawn)"


# --- Chrome trace event format ------------------------------------------------------------------------------

_TRACK_ORDER = ("regions", "compute", "point-to-point", "collectives", "waits", "saves")


def chrome_trace(runs: list[dict], report: dict | None = None) -> dict:
    """The runs as Chrome trace events: one process per rank of each run (named "rank R: run"), one track
    per kind of work (compute, point-to-point, collectives, waits, saves, regions); times in microseconds
    on one axis, runs where they happened. ``report``: the report's data (``Report.to_dict()``), whose
    verdicts go into ``otherData``."""
    runs = [r for r in (T.read_run(run) for run in runs) if r is not None]
    base = min((run["origin"] for run in runs), default=0.0)
    out: list[dict] = []
    for index, run in enumerate(runs):
        offset = (run["origin"] - base) * 1e6
        for r in run["ranks"]:
            pid = index * 1000 + r["rank"]
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                        "args": {"name": f"rank {r['rank']}: {run['label']}"}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            tracks = {}
            for e in r["events"]:
                track = T.TRACKS[e["kind"]]
                tid = (_TRACK_ORDER.index(track) + 1) * 100 + e.get("thread", 0)
                if tid not in tracks:
                    tracks[tid] = track + (f" (thread {e['thread']})" if e.get("thread") else "")
                args = {k: e[k] for k in ("op", "label", "bytes", "peer", "async") if k in e}
                out.append({"ph": "X", "name": _event_name(e), "cat": e["kind"], "pid": pid, "tid": tid,
                            "ts": round(offset + e["t0"] * 1e6, 3), "dur": round((e["t1"] - e["t0"]) * 1e6, 3),
                            "args": args})
            for tid, name in sorted(tracks.items()):
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
                out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                            "args": {"sort_index": tid}})
    other = {"generator": "ddp-grade"}
    if isinstance(report, dict):
        other.update({k: report.get(k) for k in ("exercise", "title", "path", "status")})
        other["checks"] = [{"id": c.get("id"), "status": c.get("status")} for c in report.get("checks") or []
                           if isinstance(c, dict)]
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def _event_name(e: dict) -> str:
    """What a slice is called in a viewer: "F3", "isend 1.0 KiB -> 1", "all_reduce 3.1 KiB"."""
    if e["kind"] in ("send", "recv"):
        arrow = "->" if e["kind"] == "send" else "<-"
        peer = "any" if "peer" not in e else str(e["peer"])
        return f"{e['op']} {_size(e.get('bytes', 0))} {arrow} {peer}"
    if e["kind"] == "collective":
        return f"{e['op']} {_size(e.get('bytes', 0))}"
    if e["kind"] == "wait":
        return f"wait {e['label']}" if e.get("label") else "wait"
    return e.get("label") or e["op"]


def trace_json(runs: list[dict], report: dict | None = None) -> str:
    return json.dumps(chrome_trace(runs, report))


# --- one HTML page -----------------------------------------------------------------------------------------

_STATUS = {"pass": "PASS", "fail": "FAIL", "error": "----", "skip": "SKIP", "not-checked": "----"}

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#fff}
header{padding:12px 20px;border-bottom:1px solid #ddd}h1{font-size:18px;margin:0 0 4px}
main{display:flex;gap:20px;padding:12px 20px;align-items:flex-start}
#timelines{flex:1 1 auto;min-width:0}#checks{flex:0 0 360px}
.run h2,#checks h2{font-size:15px;margin:14px 0 6px}svg{display:block;width:100%;height:auto}
.axis{font-size:10px;fill:#666}.lane-name{font-size:12px;fill:#222}.ev-text{font-size:9px;fill:#000;pointer-events:none}
.ev.forward{fill:#6baed6}.ev.backward{fill:#fd8d3c}.ev.step{fill:#74c476}.ev.save{fill:#9e9ac8}
.ev.collective{fill:#e7298a}.ev.send{fill:#66a61e}.ev.recv{fill:#1b9e77}.ev.wait{fill:#bbb}
.region{fill:#f3f3f3;stroke:#ccc}.region-name{font-size:10px;fill:#555}
#checks ul{list-style:none;padding:0;margin:0}#checks li{padding:4px 0;border-bottom:1px solid #eee}
.verdict{font:bold 12px monospace;margin-right:6px}.pass .verdict{color:#1a7f37}.fail .verdict{color:#cf222e}
.skip .verdict{color:#0969da}.msg{white-space:pre-wrap;font-size:12px;color:#555;margin:2px 0 0 44px}
.legend span{display:inline-block;margin-right:10px;font-size:12px}.legend i{display:inline-block;width:10px;
height:10px;margin-right:3px;vertical-align:middle}
"""

# Draws every run of the data as SVG lanes: one <g class="lane" data-run data-rank> per rank, one <rect class="ev
# KIND" data-kind data-op data-label data-t0 data-t1 ...> per event. Text goes in with textContent only.
_SCRIPT = r"""
(function () {
  var NS = "http://www.w3.org/2000/svg";
  var ROWS = {forward: 0, backward: 0, step: 0, save: 0, collective: 1, send: 1, recv: 1, wait: 1};
  var data = JSON.parse(document.getElementById("timeline-data").textContent);
  var root = document.getElementById("timelines");
  function el(tag, attrs, parent) {
    var node = document.createElementNS(NS, tag);
    for (var k in attrs) node.setAttribute(k, String(attrs[k]));
    if (parent) parent.appendChild(node);
    return node;
  }
  function words(e) {
    var s = e.kind + " " + e.op + (e.label ? " " + e.label : "");
    if (e.bytes !== undefined) s += ", " + e.bytes + " bytes";
    if (e.peer !== undefined) s += (e.kind === "recv" ? " from rank " : " to rank ") + e.peer;
    return s + ", " + (e.t0 * 1000).toFixed(3) + "-" + (e.t1 * 1000).toFixed(3) + " ms";
  }
  data.runs.forEach(function (run, index) {
    var box = document.createElement("div");
    box.className = "run";
    box.setAttribute("data-run", index);
    var title = document.createElement("h2");
    title.textContent = run.label + " (" + (run.span * 1000).toFixed(1) + " ms)";
    box.appendChild(title);
    root.appendChild(box);
    var W = 1000, left = 70, laneH = 34, top = 22, span = run.span > 0 ? run.span : 1e-6;
    var height = top + run.ranks.length * laneH + 8;
    var svg = el("svg", {viewBox: "0 0 " + W + " " + height, "class": "run-svg"}, box);
    function x(t) { return left + (W - left - 10) * t / span; }
    for (var i = 0; i <= 4; i++) {
      var t = span * i / 4;
      var anchor = i === 0 ? "start" : i === 4 ? "end" : "middle";
      var tick = el("text", {x: x(t), y: 12, "class": "axis", "text-anchor": anchor}, svg);
      tick.textContent = (t * 1000).toFixed(2) + " ms";
    }
    run.ranks.forEach(function (rank, row) {
      var y = top + row * laneH;
      var lane = el("g", {"class": "lane", "data-run": index, "data-rank": rank.rank}, svg);
      var name = el("text", {x: 4, y: y + 18, "class": "lane-name"}, lane);
      name.textContent = "rank " + rank.rank;
      rank.events.forEach(function (e) {
        var x0 = x(e.t0), w = Math.max(x(e.t1) - x0, 1);
        if (e.kind === "region") {
          var band = el("rect", {x: x0, y: y, width: w, height: laneH - 4, "class": "region", "data-kind": "region",
                                 "data-label": e.label || ""}, lane);
          el("title", {}, band).textContent = "region " + (e.label || "");
          return;
        }
        var r = ROWS[e.kind] || 0;
        var attrs = {x: x0, y: y + 2 + r * 15, width: w, height: 13, "class": "ev " + e.kind, "data-kind": e.kind,
                     "data-op": e.op, "data-label": e.label || "", "data-t0": e.t0, "data-t1": e.t1};
        if (e.bytes !== undefined) attrs["data-bytes"] = e.bytes;
        if (e.peer !== undefined) attrs["data-peer"] = e.peer;
        var rect = el("rect", attrs, lane);
        el("title", {}, rect).textContent = words(e);
        if (e.label && w > 14) {
          var tag = el("text", {x: x0 + 2, y: y + 12 + r * 15, "class": "ev-text"}, lane);
          tag.textContent = e.label;
        }
      });
    });
  });
  document.body.setAttribute("data-drawn", String(data.runs.length));
})();
"""


def html_page(runs: list[dict], report: dict | None = None) -> str:
    """One page, nothing fetched (no network, no CDN: a Content-Security-Policy forbids it): the runs drawn
    as lanes by the page's own script, the check verdicts beside them. ``report``: ``Report.to_dict()``."""
    runs = [r for r in (T.read_run(run) for run in runs) if r is not None]
    report = report if isinstance(report, dict) else {}
    title = f"Exercise {report.get('exercise')}: {report.get('title')}" if report.get("exercise") else "ddp-grade"
    payload = json.dumps({"runs": runs}).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") \
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    legend = "".join(f'<span><i class="ev {k}" style="background:{c}"></i>{html.escape(w)}</span>'
                     for k, c, w in (("forward", "#6baed6", "forward"), ("backward", "#fd8d3c", "backward"),
                                     ("step", "#74c476", "optimizer step"), ("save", "#9e9ac8", "save"),
                                     ("collective", "#e7298a", "collective"), ("send", "#66a61e", "send"),
                                     ("recv", "#1b9e77", "receive"), ("wait", "#bbb", "wait")))
    checks = []
    for c in report.get("checks") or []:
        if not isinstance(c, dict):
            continue
        status = str(c.get("status"))
        message = f'<div class="msg">{html.escape(str(c.get("message") or ""))}</div>' if c.get("message") else ""
        checks.append(f'<li class="{html.escape(status)}" data-check="{html.escape(str(c.get("id")))}">'
                      f'<span class="verdict">{html.escape(_STATUS.get(status, status))}</span>'
                      f'<code>{html.escape(str(c.get("id")))}</code> {html.escape(str(c.get("title") or ""))}'
                      f'{message}</li>')
    counts = report.get("counts") if isinstance(report.get("counts"), dict) else {}
    head = " &middot; ".join(html.escape(str(x)) for x in (report.get("path", ""), report.get("status", ""),
                                                            f"{counts.get('pass', 0)} checks passed") if x)
    empty = "" if runs else "<p>No rank recorded a timeline in this grading.</p>"
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'\">"
        f"<title>{html.escape(title)}: what each rank did</title><style>{_STYLE}</style></head><body>"
        f"<header><h1>{html.escape(title)}</h1><p>{head}</p><p class=\"legend\">{legend}</p></header>"
        f"<main><section id=\"timelines\">{empty}</section>"
        f"<aside id=\"checks\"><h2>Checks</h2><ul>{''.join(checks)}</ul></aside></main>"
        f"<script type=\"application/json\" id=\"timeline-data\">{payload}</script>"
        f"<script>{_SCRIPT}</script>"
        "<noscript><p>The lanes are drawn by this page's script; the trace data is in the page.</p></noscript>"
        "</body></html>\n")


def write(path: str, report: dict) -> int:
    """The timelines of ``report`` (``Report.to_dict()``) into ``path``: a page when it ends in .html, else the
    Chrome trace JSON. Returns how many runs it holds; OSError when the file cannot be written."""
    runs = T.runs_in(report.get("sections") if isinstance(report, dict) else None)
    body = html_page(runs, report) if str(path).lower().endswith((".html", ".htm")) else trace_json(runs, report)
    with open(path, "w", encoding="utf-8") as f:
        f.write(body)
    return len(runs)
