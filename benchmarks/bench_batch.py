"""How long `ddp-grade batch` takes on one set of submissions with --jobs 1, 2 and 4, sandboxed or not.

    python benchmarks/bench_batch.py [--repeat 1] [--jobs 1 2 4] [--sandbox on off]

The set: the solutions of exercises 01, 02, 05 and 07, three hostile files that
fail fast (segfault, os._exit, one rank raises) and one that hangs until its
timeout (endless loop, --timeout 10). Prints the wall-clock seconds of each
run side by side, and its exit code (3: the worst result is the timeout).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = [
    ("s01", ROOT / "solutions" / "01_setup.py", "01_setup.py"),
    ("s02", ROOT / "solutions" / "02_shard.py", "02_shard.py"),
    ("s05", ROOT / "solutions" / "05_allreduce.py", "05_allreduce.py"),
    ("s07", ROOT / "solutions" / "07_ring_allreduce.py", "07_ring_allreduce.py"),
    ("h1", ROOT / "tests" / "hostile" / "01_segfault.py", "01_setup.py"),
    ("h2", ROOT / "tests" / "hostile" / "01_os_exit.py", "01_setup.py"),
    ("h3", ROOT / "tests" / "hostile" / "01_one_rank_raises.py", "01_setup.py"),
    ("h4", ROOT / "tests" / "hostile" / "01_endless_loop.py", "01_setup.py"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sandbox", nargs="+", choices=["on", "off"], default=["off", "on"],
                        help="on: a sandbox per submission (needs bwrap or unshare); off: --no-sandbox")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    try:
        for name, src, as_name in FILES:
            (work / "class" / name).mkdir(parents=True)
            shutil.copy(src, work / "class" / name / as_name)
        env = {**os.environ, "DDP_GRADE_STATE_DIR": str(work / "state")}
        print(f"{len(FILES)} submissions, {os.cpu_count()} CPU cores, load average "
              f"{os.getloadavg()[0]:.1f} at the start")
        print(f"{'sandbox':>7}  {'jobs':>5}  {'seconds':>8}  exit")
        for _ in range(args.repeat):
            for sandbox in args.sandbox:
                for jobs in args.jobs:
                    started = time.monotonic()
                    proc = subprocess.run(
                        [sys.executable, "-c", "from grader.cli import main; main()", "batch", str(work / "class"),
                         "--jobs", str(jobs), "--timeout", "10", "-q", "--sandbox" if sandbox == "on" else
                         "--no-sandbox"], env=env, capture_output=True, text=True)
                    print(f"{sandbox:>7}  {jobs:>5}  {time.monotonic() - started:>8.1f}  {proc.returncode}",
                          flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
