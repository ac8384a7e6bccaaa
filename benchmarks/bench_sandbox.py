"""What grading under a sandbox costs at two commits, and beside the same grading without one, side by side on
this machine, one after the other.

    python benchmarks/bench_sandbox.py [--base COMMIT] [--head COMMIT] [--repeat 5] [--batch 30] [--tool bwrap]
                                       [--no-base]

Per commit: a `ddp-grade FILE --sandbox` of the solution of 01 and of 03 and the same `ddp-grade FILE`
without a sandbox (each the median of --repeat gradings after one that warms the page cache, no grading
server), and a sandboxed `ddp-grade batch` of --batch solutions (01, 02, 03, 05 and 07 in turn, one
learner's folder each, the default --jobs). Each commit is checked out into a temporary worktree that uses
this checkout's virtual environment (the kit put first on the path). The target of the containment work:
the head at most 1.2 times the base; the last lines give what the sandbox adds to a grading, at each
commit (--no-base: the head only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 1.2
PLAIN_FILES = ["01_setup.py", "03_train.py"]
BATCH_FILES = ["01_setup.py", "02_shard.py", "03_train.py", "05_allreduce.py", "07_ring_allreduce.py"]


def worktree(commit: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="ddp-grade-bench-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), commit], cwd=ROOT, check=True,
                   capture_output=True)
    return folder


def timed(tree: Path, args: list[str], env: dict) -> tuple[float, int]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "grader", *args], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode not in (0,):
        print(f"note: ddp-grade {' '.join(args)} at {tree.name} exited {done.returncode}: "
              f"{(done.stdout + done.stderr).strip().splitlines()[-1:]}")
    return time.perf_counter() - started, done.returncode


def measure(tree: Path, repeat: int, batch: int, tool: str | None, scratch: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1", "DDP_GRADE_SERVER": "0",
           "DDP_GRADE_STATE_DIR": str(scratch / "state")}
    if tool:
        env["DDP_GRADE_SANDBOX_TOOL"] = tool
    out = {}
    for name in PLAIN_FILES:
        path = str(tree / "solutions" / name)
        for mode, flags in (("plain", []), ("--sandbox", ["--sandbox"])):
            timed(tree, [path, *flags, "-q"], env)  # warms the page cache
            out[f"{mode} {name}"] = statistics.median(timed(tree, [path, *flags, "-q"], env)[0]
                                                      for _ in range(repeat))
    learners = scratch / "class"
    shutil.rmtree(learners, ignore_errors=True)
    for k in range(batch):
        name = BATCH_FILES[k % len(BATCH_FILES)]
        (learners / f"learner{k:02d}").mkdir(parents=True)
        shutil.copy(tree / "solutions" / name, learners / f"learner{k:02d}" / name)
    out[f"batch of {batch} solutions"] = timed(tree, ["batch", str(learners), "--sandbox", "-q"], env)[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="a800471", help="the commit to compare with (default: before containment)")
    parser.add_argument("--head", default="HEAD")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, default=30)
    parser.add_argument("--tool", choices=["bwrap", "unshare"], default=None)
    parser.add_argument("--no-base", action="store_true", help="measure the head only (the sandbox against none)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the start, "
          f"tool {args.tool or 'the default'}")
    commits = [args.head] if args.no_base else [args.base, args.head]
    results = {}
    for commit in commits:
        tree = worktree(commit)
        scratch = Path(tempfile.mkdtemp(prefix="ddp-grade-bench-run-"))
        try:
            results[commit] = measure(tree, args.repeat, args.batch, args.tool, scratch)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
            shutil.rmtree(tree, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'':32}" + "".join(f" {c:>10}" for c in commits) + ("" if args.no_base else "  ratio"))
    for key in results[args.head]:
        row = f"{key:32}" + "".join(f" {results[c][key]:>9.2f}s" for c in commits)
        if not args.no_base:
            ratio = results[args.head][key] / results[args.base][key]
            row += f"  {ratio:.2f}" + ("" if ratio <= TARGET_RATIO else f"  (over {TARGET_RATIO})")
        print(row)
    for commit in commits:
        for name in PLAIN_FILES:
            ratio = results[commit][f"--sandbox {name}"] / results[commit][f"plain {name}"]
            print(f"at {commit}: --sandbox {name} is {ratio:.2f} times the plain grading")

if __name__ == "__main__":
    main()
