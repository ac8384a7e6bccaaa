"""``ddp-grade doctor``: is this machine ready to grade? The first thing to run when something is off."""

from __future__ import annotations

from grader.diagnose import rank_record
from grader.report import rank_line

import os
import platform
import sys
import time
from dataclasses import dataclass

OK, WARN, BAD = "ok", "warn", "bad"


@dataclass
class Finding:
    name: str
    status: str  # ok, warn (works, but worth knowing) or bad (grading will not work)
    detail: str


def findings(run_group: bool = True, timeout_s: float = 60.0) -> list[Finding]:
    out = [Finding("python", OK if sys.version_info >= (3, 10) else BAD,
                   f"{platform.python_version()} ({sys.executable})")]
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        out.append(Finding("torch", BAD, f"cannot import torch: {type(exc).__name__}: {exc}"))
        return out
    out.append(Finding("torch", OK, f"{torch.__version__} ({os.path.dirname(torch.__file__)})"))
    if not dist.is_available():
        out.append(Finding("torch.distributed", BAD, "this torch build has no torch.distributed"))
        return out
    out.append(Finding("gloo", OK if dist.is_gloo_available() else BAD,
                       "available" if dist.is_gloo_available() else "not in this torch build (CPU grading needs it)"))
    nccl = dist.is_nccl_available()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out.append(Finding("nccl", OK, "available" if nccl else "not in this torch build (fine: gloo is used on CPU)"))
    out.append(Finding("gpus", OK, f"{gpus} CUDA device{'s' if gpus != 1 else ''}"
                       + ("; --backend auto uses nccl when there is one per rank" if gpus and nccl else
                          "; grading uses gloo on CPU")))
    out.append(Finding("cpus", OK, f"{os.cpu_count()} logical CPU{'s' if os.cpu_count() != 1 else ''}"))
    out.append(_state_folder())
    out.append(_kit())
    out.append(_server())
    out.append(_sandbox())
    if run_group:
        out.append(process_group(timeout_s))
    return out


def _state_folder() -> Finding:
    from grader.state import state_dir

    folder = state_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".doctor-write-test"
        probe.write_text("ok", encoding="utf-8")
        probe.unlink()
    except OSError as exc:
        return Finding("state folder", BAD, f"{folder} is not writable ({exc.strerror or exc}); "
                       "set DDP_GRADE_STATE_DIR to a writable folder")
    return Finding("state folder", OK, str(folder))


def _sandbox() -> Finding:
    from grader import sandbox

    found = sandbox.tool()
    if found is None:
        return Finding("sandbox", WARN, "neither bwrap nor unshare works here: `--sandbox` is refused and "
                       "`batch` grades unsandboxed (apt-get install bubblewrap)")
    how = "bubblewrap" if found == sandbox.BWRAP else "unshare (user namespaces)"
    return Finding("sandbox", OK, f"`--sandbox` uses {how}; `batch` uses it for every submission")


def _server() -> Finding:
    from grader import server

    if not server.enabled():
        return Finding("server", OK, "off (DDP_GRADE_SERVER=0): every grading starts its own pool")
    found = server.status()
    if not found["running"]:
        return Finding("server", OK, "not running; the next `ddp-grade FILE` starts one for the gradings after it")
    state = "current" if found["current"] else "stale (the grader changed; the next grading replaces it)"
    return Finding("server", OK, f"running, pid {found['pid']}, {state}, {found['gradings']} grading(s) served, "
                   f"socket {found['socket']}")


def _kit() -> Finding:
    from grader import kit

    try:
        return Finding("exercises", OK, str(kit.root() / "exercises"))
    except kit.KitError as exc:
        return Finding("exercises", WARN, str(exc))


def process_group(timeout_s: float) -> Finding:
    """Start a 2-rank gloo group through the harness, all-reduce once, and time it."""
    from grader.rank import harness

    started = time.monotonic()
    try:
        harness.warm_up(dynamo=False)
        with harness.Session() as session:
            t0 = time.monotonic()
            outcome = session.run("grader.commands.doctor:rank_main", 2, learner_path=os.devnull,
                                  timeout_s=timeout_s, backend="gloo")
            seconds = time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - report, do not crash
        return Finding("process group", BAD, f"could not start ranks: {type(exc).__name__}: {exc}")
    if outcome.timed_out:
        return Finding("process group", BAD, f"a 2-rank gloo group did not finish in {timeout_s:g} s "
                       "(a firewall, or GLOO_SOCKET_IFNAME naming a missing interface?)")
    if not outcome.ok:
        bad = outcome.failures() or outcome.ranks
        return Finding("process group", BAD, "a 2-rank gloo group failed: " + rank_line(rank_record(bad[0], "")))
    sums = [r.get("sum") for r in outcome.results()]
    if sums != [3.0, 3.0]:
        return Finding("process group", BAD, f"all-reduce of 1 and 2 gave {sums}, not 3 on both ranks")
    total = time.monotonic() - started
    return Finding("process group", OK, f"2 gloo ranks joined, all-reduced and left in {seconds:.2f} s "
                   f"({total:.2f} s with starting the process pool that preloads torch)")


def healthy(found: list[Finding]) -> bool:
    return all(f.status != BAD for f in found)


def render(found: list[Finding]) -> str:
    marks = {OK: "ok  ", WARN: "warn", BAD: "FAIL"}
    width = max(len(f.name) for f in found)
    lines = [f"  {marks[f.status]}  {f.name.ljust(width)}  {f.detail}" for f in found]
    lines.append("")
    lines.append("Everything needed to grade works here." if healthy(found)
                 else "Something above needs fixing before grading can work (exit 1).")
    return "\n".join(lines)


def rank_main(ctx) -> dict:
    """Runs in each rank of the doctor's group: join, all-reduce rank+1, leave."""
    import torch
    import torch.distributed as dist

    ctx.init_group()
    try:
        t = torch.tensor([float(ctx.rank + 1)])
        dist.all_reduce(t)
        return {"sum": float(t.item())}
    finally:
        ctx.leave_group()
