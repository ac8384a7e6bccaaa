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
LEGEND = "F forward B backward O step S save | C collective > send < recv w wait g grader"
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
                rows[1][c] = "g" if e.get("by") == T.GRADER else SYMBOLS[e["kind"]]
        lane = f"  rank {r['rank']}"[:LANE_PREFIX].ljust(LANE_PREFIX)
        lines.append(_fit(lane + "|" + "".join(rows[0]) + "|", width))
        lines.append(_fit(" " * LANE_PREFIX + "|" + "".join(rows[1]) + "|", width))
        counted += _wrap(f"  rank {r['rank']}: " + _counted(inside, r["dropped"], r["problem"]), width)
    return lines + counted


def _counted(events: list[dict], dropped: int = 0, problem: str = "") -> str:
    """"4 forwards, 4 backwards | to 1: 4 x 1.0 KiB | from 1: 4 x 1.0 KiB | all_reduce x3 3.1 KiB | 4 waits"."""
    graders = [e for e in events if e.get("by") == T.GRADER]
    events = [e for e in events if e.get("by") != T.GRADER]  # the learner's counts are the learner's calls
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
    for e in events:
        if e.get("open"):
            toward = "" if "peer" not in e else f" {'from' if e['kind'] == 'recv' else 'to'} {e['peer']}"
            parts.append(f"still in {e['op']}{toward} when the run stopped")
    if graders:
        own: dict[str, int] = {}
        for e in graders:
            own[e["op"]] = own.get(e["op"], 0) + 1
        parts.append("the grader's own, not counted: " + ", ".join(f"{op} x{n}" for op, n in own.items()))
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

GRADER_TRACK = "the grader's own calls"  # its checks' agreement between ranks, its barriers: not the learner's
_TRACK_ORDER = ("regions", "compute", "point-to-point", "collectives", "waits", "saves", GRADER_TRACK)


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
                track = GRADER_TRACK if e.get("by") == T.GRADER else T.TRACKS[e["kind"]]
                tid = (_TRACK_ORDER.index(track) + 1) * 100 + e.get("thread", 0)
                if tid not in tracks:
                    tracks[tid] = track + (f" (thread {e['thread']})" if e.get("thread") else "")
                args = {k: e[k] for k in ("op", "label", "bytes", "peer", "async", "by", "open") if k in e}
                category = T.GRADER if e.get("by") == T.GRADER else e["kind"]
                out.append({"ph": "X", "name": _event_name(e), "cat": category, "pid": pid, "tid": tid,
                            "ts": round(offset + e["t0"] * 1e6, 3), "dur": round((e["t1"] - e["t0"]) * 1e6, 3),
                            "args": args})
            for tid, name in sorted(tracks.items()):
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
                out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                            "args": {"sort_index": tid}})
    other = {"generator": "ddp-grade"}
    if isinstance(report, dict):
        other.update({k: report.get(k) for k in ("exercise", "title", "path", "status")})
        if isinstance(report.get("problem"), str) and report["problem"]:
            other["problem"] = report["problem"]
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
        return f"{'grader: ' if e.get('by') == T.GRADER else ''}{e['op']} {_size(e.get('bytes', 0))}"
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
#problem{margin:8px 0;padding:8px 12px;border-left:4px solid #cf222e;background:#fff5f5}
#problem pre{margin:0;white-space:pre-wrap;font:13px/1.4 monospace}
main{display:flex;gap:20px;padding:12px 20px;align-items:flex-start}
#timelines{flex:1 1 auto;min-width:0}#checks{flex:0 0 360px}
.run h2,.slots h2,#checks h2{font-size:15px;margin:18px 0 6px}svg{display:block}
.axis{font-size:11px;fill:#666}.lane-name{font-size:12px;fill:#222}.ev-text{font-size:10px;fill:#000;pointer-events:none}
.ev.forward{fill:#6baed6}.ev.backward{fill:#fd8d3c}.ev.step{fill:#74c476}.ev.save{fill:#9e9ac8}
.ev.collective{fill:#e7298a}.ev.send{fill:#66a61e}.ev.recv{fill:#1b9e77}.ev.wait{fill:#bbb}
.ev.grader{fill:#ddd;stroke:#999;stroke-dasharray:2 2}.grader-text{font-size:10px;fill:#777;pointer-events:none}
.ev.open{stroke:#cf222e;stroke-width:2}.stopped{stroke:#cf222e;stroke-dasharray:4 3}
.hung-text{font-size:11px;fill:#cf222e;font-weight:bold}
.region{fill:#f3f3f3;stroke:#ccc}.region-band{fill:#eef3fb;stroke:#9ab}.region-name{font-size:11px;fill:#234}
.controls{font-size:12px;margin:2px 0 4px}.controls button{font-size:12px;margin:0 4px 4px 0}
.counts{font:12px/1.35 monospace;white-space:pre-wrap;color:#333;margin:4px 0 0}
table.slot-table{border-collapse:collapse;font:12px monospace;margin:4px 0}
.slot-table th{text-align:left;padding:1px 8px 1px 0;font-weight:normal;white-space:nowrap}
.slot-table td{border:1px solid #ddd;min-width:2.4em;text-align:center;padding:1px 2px}
.slot-table td.idle{color:#bbb;background:#fafafa}.slot-table td.F{background:#deebf7}
.slot-table td.B{background:#fdd0a2}.slot-table td.note{border:none;text-align:left;color:#555;white-space:nowrap}
.slots pre{font:12px/1.35 monospace;white-space:pre-wrap;color:#333}.slot-wrap{overflow-x:auto}
#checks ul{list-style:none;padding:0;margin:0}#checks li{padding:4px 0;border-bottom:1px solid #eee}
.verdict{font:bold 12px monospace;margin-right:6px}.pass .verdict{color:#1a7f37}.fail .verdict{color:#cf222e}
.skip .verdict{color:#0969da}.msg{white-space:pre-wrap;font-size:12px;color:#555;margin:2px 0 0 44px}
.legend span{display:inline-block;margin-right:10px;font-size:12px}.legend i{display:inline-block;width:10px;
height:10px;margin-right:3px;vertical-align:middle}.keys{font-size:12px;color:#555}
"""

# Draws every part of the data in order: a run as SVG lanes, one <g class="lane" data-run data-rank> per rank, one
# <rect class="ev KIND" data-kind data-op data-label ...> per event (a region: a band), the regions' names in a row
# above (<text class="region-name" data-region>); a slot view as a table, one <tr class="slot-row" data-rank> per
# rank. Zoom and pan redraw at the same font size: the wheel or + and - over a run, the arrows, 0 for the whole
# run; a button per region; "compute only" hides what was sent, received and waited for. Text goes in with
# textContent only.
_SCRIPT = r"""
(function () {
  var NS = "http://www.w3.org/2000/svg";
  var ROWS = {forward: 0, backward: 0, step: 0, save: 0, collective: 1, send: 1, recv: 1, wait: 1};
  var data = JSON.parse(document.getElementById("timeline-data").textContent);
  var root = document.getElementById("timelines");
  var views = [], active = null;
  function el(tag, attrs, parent) {
    var node = document.createElementNS(NS, tag);
    for (var k in attrs) node.setAttribute(k, String(attrs[k]));
    if (parent) parent.appendChild(node);
    return node;
  }
  function html(tag, cls, parent, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }
  function words(e) {
    var s = (e.by === "grader" ? "the grader's own " : "") + e.kind + " " + e.op + (e.label ? " " + e.label : "");
    if (e.bytes !== undefined) s += ", " + e.bytes + " bytes";
    if (e.peer !== undefined) s += (e.kind === "recv" ? " from rank " : " to rank ") + e.peer;
    if (e.open) s += ", still waiting when the run stopped";
    return s + ", " + (e.t0 * 1000).toFixed(3) + "-" + (e.t1 * 1000).toFixed(3) + " ms";
  }
  function ms(t) { return (t * 1000).toFixed(t < 0.01 ? 3 : 2) + " ms"; }
  function draw(view) {
    var run = view.run, svg = view.svg, span = run.span > 0 ? run.span : 1e-6;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var W = Math.max(view.box.clientWidth || 1000, 400), left = 64, right = 10, laneH = view.computeOnly ? 24 : 40;
    var regionsRow = view.regions.length ? 18 : 0, top = 18 + regionsRow;
    var height = top + run.ranks.length * laneH + 6;
    svg.setAttribute("width", W); svg.setAttribute("height", height);
    svg.setAttribute("viewBox", "0 0 " + W + " " + height);
    var a = view.a, b = view.b, plot = W - left - right;
    function x(t) { return left + plot * (t - a) / (b - a); }
    var clip = el("clipPath", {id: "clip-" + view.index}, el("defs", {}, svg));
    el("rect", {x: left, y: 0, width: plot, height: height}, clip);
    for (var i = 0; i <= 4; i++) {
      var t = a + (b - a) * i / 4;
      var tick = el("text", {x: left + plot * i / 4, y: 12, "class": "axis",
                             "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle"}, svg);
      tick.textContent = ms(t);
    }
    var body = el("g", {"clip-path": "url(#clip-" + view.index + ")"}, svg);
    view.regions.forEach(function (p) {
      var x0 = x(p.t0), w = Math.max(x(p.t1) - x0, 1);
      el("rect", {x: x0, y: 16, width: w, height: regionsRow - 2, "class": "region-band"}, body);
      var name = el("text", {x: Math.max(x0, left) + 3, y: 16 + regionsRow - 6, "class": "region-name",
                             "data-region": p.label}, body);
      var room = Math.max(0, Math.floor((Math.min(x0 + w, left + plot) - Math.max(x0, left) - 6) / 6.5));
      name.textContent = p.label.length <= room ? p.label : room > 3 ? p.label.slice(0, room - 1) + "\u2026" : "";
      el("title", {}, name).textContent = "region " + p.label;
    });
    run.ranks.forEach(function (rank, row) {
      var y = top + row * laneH;
      var lane = el("g", {"class": "lane", "data-run": view.index, "data-rank": rank.rank}, svg);
      var name = el("text", {x: 4, y: y + 16, "class": "lane-name"}, lane);
      name.textContent = "rank " + rank.rank;
      var inner = el("g", {"clip-path": "url(#clip-" + view.index + ")"}, lane);
      rank.events.forEach(function (e) {
        var x0 = x(e.t0), w = Math.max(x(e.t1) - x0, 1);
        if (e.kind === "region") {
          var band = el("rect", {x: x0, y: y, width: w, height: laneH - 4, "class": "region", "data-kind": "region",
                                 "data-label": e.label || ""}, inner);
          el("title", {}, band).textContent = "region " + (e.label || "");
          return;
        }
        var r = ROWS[e.kind] || 0;
        var hidden = view.computeOnly && r === 1;
        var cls = "ev " + e.kind + (e.by === "grader" ? " grader" : "") + (e.open ? " open" : "");
        var attrs = {x: x0, y: y + 2 + r * 17, width: w, height: hidden ? 0 : 14, "class": cls, "data-kind": e.kind,
                     "data-op": e.op, "data-label": e.label || "", "data-t0": e.t0, "data-t1": e.t1};
        if (e.bytes !== undefined) attrs["data-bytes"] = e.bytes;
        if (e.peer !== undefined) attrs["data-peer"] = e.peer;
        if (e.by) attrs["data-by"] = e.by;
        if (e.open) attrs["data-open"] = "true";
        var rect = el("rect", attrs, inner);
        el("title", {}, rect).textContent = words(e);
        if (hidden) return;
        var text = e.by === "grader" ? "grader: " + e.op : e.open ? "" : e.label;
        if (text && w > 6.5 * Math.min(text.length, 3)) {
          var tag = el("text", {x: x0 + 2, y: y + 13 + r * 17, "class": e.by === "grader" ? "grader-text" : "ev-text"},
                       inner);
          tag.textContent = text.length * 6.5 <= w ? text : text.slice(0, Math.max(1, Math.floor(w / 6.5) - 1)) + "\u2026";
        }
        if (e.open) {
          var note = el("text", {x: Math.min(x0 + 2, left + plot - 4), y: y + 13 + r * 17, "class": "hung-text",
                                 "data-hung": rank.rank}, inner);
          note.textContent = "last call: " + e.op + (e.peer !== undefined ? (e.kind === "recv" ? " from " : " to ") +
                             e.peer : "") + ", still waiting";
        }
      });
      if (rank.stopped !== undefined) {
        var sx = x(rank.stopped);
        el("line", {x1: sx, x2: sx, y1: y, y2: y + laneH - 4, "class": "stopped"}, inner);
      }
    });
  }
  function zoom(view, factor, at) {
    var a = view.a, b = view.b, t = at === undefined ? (a + b) / 2 : at;
    var span = view.run.span > 0 ? view.run.span : 1e-6;
    var width = Math.min(span, Math.max(span * 1e-4, (b - a) * factor));
    var na = t - (t - a) * width / (b - a);
    view.a = Math.max(0, Math.min(na, span - width)); view.b = view.a + width;
    draw(view);
  }
  function pan(view, share) {
    var span = view.run.span > 0 ? view.run.span : 1e-6, width = view.b - view.a;
    view.a = Math.max(0, Math.min(view.a + width * share, span - width)); view.b = view.a + width;
    draw(view);
  }
  function show(view, a, b) { view.a = a; view.b = b; draw(view); }
  var runIndex = 0;
  data.parts.forEach(function (part) {
    if (part.kind === "slots") {
      var box = html("div", "slots", root);
      html("h2", "", box, part.title);
      if (part.view.caption) html("p", "caption", box, part.view.caption);
      var wrap = html("div", "slot-wrap", box);
      var table = html("table", "slot-table", wrap);
      part.view.rows.forEach(function (row) {
        var tr = html("tr", "slot-row", table);
        tr.setAttribute("data-rank", row.name);
        html("th", "", tr, row.name);
        row.cells.forEach(function (cell) {
          html("td", cell ? cell.charAt(0) : "idle", tr, cell || ".");
        });
        if (row.note) html("td", "note", tr, row.note);
      });
      if (part.text) html("pre", "summary", box, part.text);
      return;
    }
    var run = part.run, index = runIndex++;
    var box = html("div", "run", root);
    box.setAttribute("data-run", index);
    box.tabIndex = 0;
    html("h2", "", box, (part.title || run.label) + " (" + (run.span * 1000).toFixed(1) + " ms)");
    var controls = html("div", "controls", box);
    var view = {index: index, run: run, box: box, a: 0, b: run.span > 0 ? run.span : 1e-6, computeOnly: false,
                regions: part.regions || []};
    var whole = html("button", "", controls, "whole run");
    whole.onclick = function () { show(view, 0, view.run.span > 0 ? view.run.span : 1e-6); };
    view.regions.forEach(function (p) {
      var button = html("button", "", controls, p.label);
      button.setAttribute("data-region", p.label);
      button.onclick = function () {
        var pad = (p.t1 - p.t0) * 0.02;
        show(view, Math.max(0, p.t0 - pad), Math.min(view.run.span, p.t1 + pad) || 1e-6);
      };
    });
    var label = html("label", "", controls);
    var tick = html("input", "", label);
    tick.type = "checkbox";
    label.appendChild(document.createTextNode(" compute only"));
    tick.onchange = function () { view.computeOnly = tick.checked; draw(view); };
    view.svg = el("svg", {"class": "run-svg"}, box);
    if (part.counts && part.counts.length) html("pre", "counts", box, part.counts.join("\n"));
    box.addEventListener("mouseenter", function () { active = view; });
    box.addEventListener("focus", function () { active = view; });
    view.svg.addEventListener("wheel", function (ev) {
      ev.preventDefault();
      var rect = view.svg.getBoundingClientRect(), left = 64, plot = rect.width - left - 10;
      var at = view.a + (view.b - view.a) * Math.min(1, Math.max(0, (ev.clientX - rect.left - left) / plot));
      zoom(view, ev.deltaY < 0 ? 0.8 : 1.25, at);
    }, {passive: false});
    views.push(view);
    draw(view);
  });
  document.addEventListener("keydown", function (ev) {
    var view = active || views[0];
    if (!view) return;
    if (ev.key === "+" || ev.key === "=") zoom(view, 0.8);
    else if (ev.key === "-" || ev.key === "_") zoom(view, 1.25);
    else if (ev.key === "ArrowLeft") pan(view, -0.2);
    else if (ev.key === "ArrowRight") pan(view, 0.2);
    else if (ev.key === "0") show(view, 0, view.run.span > 0 ? view.run.span : 1e-6);
    else return;
    ev.preventDefault();
  });
  window.addEventListener("resize", function () { views.forEach(draw); });
  document.body.setAttribute("data-drawn", String(views.length));
})();
"""


def _text(value, limit: int = 6000) -> str:
    """A section's text (several lines) made safe: printable ASCII and newlines, at most ``limit`` characters."""
    if not isinstance(value, str):
        return ""
    return "\n".join(T.clean_name(line, 400) for line in value[:limit].splitlines())


def page_parts(runs: list[dict], report: dict) -> list[dict]:
    """What the page draws, in the report's order: each run (its lanes, its regions, each rank's counts) under
    its section's title, and each slot view a check measured (:data:`grader.timeline.SLOT_KEY`) with the
    section's text. Runs handed in that no section holds come first."""
    parts = []
    sections = report.get("sections") if isinstance(report.get("sections"), list) else []
    in_sections = []
    for section in sections:
        if not isinstance(section, dict) or not isinstance(section.get("data"), dict):
            continue
        data, title = section["data"], T.clean_name(section.get("title"), 200)
        if T.KEY in data:
            run = T.read_run(data[T.KEY])
            if run is not None:
                in_sections.append(run)
                parts.append(_run_part(run, title))
        view = T.read_slot_view(data.get(T.SLOT_KEY))
        if view is not None:
            parts.append({"kind": "slots", "title": title, "view": view, "text": _text(section.get("text"))})
    alone = [run for run in runs if not any(run is r or run == r for r in in_sections)]
    return [_run_part(run, run["label"]) for run in alone] + parts


def _run_part(run: dict, title: str) -> dict:
    counts = []
    for r in run["ranks"]:
        counts += _wrap(f"rank {r['rank']}: " + _counted(r["events"], r["dropped"], r["problem"]), 110)
    return {"kind": "run", "title": title, "run": run, "regions": T.regions(run), "counts": counts}


def html_page(runs: list[dict], report: dict | None = None) -> str:
    """One page, nothing fetched (no network, no CDN: a Content-Security-Policy forbids it): the runs drawn
    as lanes by the page's own script, the slot views the checks measured, the check verdicts beside them and
    the report's problem (``report["problem"]``, as the terminal says it) at the top. ``report``:
    ``Report.to_dict()``, with ``problem`` added."""
    runs = [r for r in (T.read_run(run) for run in runs) if r is not None]
    report = report if isinstance(report, dict) else {}
    title = f"Exercise {report.get('exercise')}: {report.get('title')}" if report.get("exercise") else "ddp-grade"
    parts = page_parts(runs, report)
    payload = json.dumps({"parts": parts}).replace("<", "\\u003c").replace(">", "\\u003e") \
        .replace("&", "\\u0026").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    legend = "".join(f'<span><i class="ev {k}" style="background:{c}"></i>{html.escape(w)}</span>'
                     for k, c, w in (("forward", "#6baed6", "forward"), ("backward", "#fd8d3c", "backward"),
                                     ("step", "#74c476", "optimizer step"), ("save", "#9e9ac8", "save"),
                                     ("collective", "#e7298a", "collective"), ("send", "#66a61e", "send"),
                                     ("recv", "#1b9e77", "receive"), ("wait", "#bbb", "wait"),
                                     ("grader", "#ddd", "the grader's own calls (not yours)")))
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
    problem = report.get("problem") if isinstance(report.get("problem"), str) else ""
    problem_html = f'<div id="problem"><pre>{html.escape(problem)}</pre></div>' if problem else ""
    empty = "" if parts else "<p>No rank recorded a timeline in this grading.</p>"
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "script-src 'unsafe-inline'\">"
        f"<title>{html.escape(title)}: what each rank did</title><style>{_STYLE}</style></head><body>"
        f"<header><h1>{html.escape(title)}</h1><p>{head}</p>{problem_html}<p class=\"legend\">{legend}</p>"
        "<p class=\"keys\">Over a run: the wheel or + and - zoom, the arrows pan, 0 shows the whole run.</p></header>"
        f"<main><section id=\"timelines\">{empty}</section>"
        f"<aside id=\"checks\"><h2>Checks</h2><ul>{''.join(checks)}</ul></aside></main>"
        f"<script type=\"application/json\" id=\"timeline-data\">{payload}</script>"
        f"<script>{_SCRIPT}</script>"
        "<noscript><p>The lanes are drawn by this page's script; the trace data is in the page.</p></noscript>"
        "</body></html>\n")


def where_written(path: str, runs: int) -> str:
    """The one line --trace says: the file, what it holds and how to open it."""
    import os

    shown = os.path.abspath(path)
    lanes = f"{runs} run{'' if runs == 1 else 's'}"
    if _is_page(path):
        from pathlib import Path

        return f"ddp-grade: wrote {shown} ({lanes}): open it in a browser ({Path(shown).as_uri()})."
    return (f"ddp-grade: wrote {shown} ({lanes}), a Chrome trace: open it in Perfetto (https://ui.perfetto.dev, "
            "Open trace file) or chrome://tracing.")


def _is_page(path) -> bool:
    return str(path).lower().endswith((".html", ".htm"))


def write(path: str, report: dict) -> int:
    """The timelines of ``report`` (``Report.to_dict()``) into ``path``: a page when it ends in .html, else the
    Chrome trace JSON. Returns how many runs it holds; OSError when the file cannot be written."""
    runs = T.runs_in(report.get("sections") if isinstance(report, dict) else None)
    body = html_page(runs, report) if _is_page(path) else trace_json(runs, report)
    with open(path, "w", encoding="utf-8") as f:
        f.write(body)
    return len(runs)
