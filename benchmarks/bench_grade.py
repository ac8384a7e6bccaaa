"""Time to grade a solution against the floor: a bare spawn, init, destroy of the same world size.

Both are timed as whole commands (a fresh Python each time, as a learner runs
them), alternately, several times; the medians are printed side by side.

    python benchmarks/bench_grade.py [--repeat 5] [--file solutions/03_train.py] [--world-size 2]

The grader runs each exercise at its default world sizes (03: 2 and then 3), so
it does more than the floor; the target is a ratio of at most 1.5.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FLOOR = r"""
import os, sys
from datetime import timedelta
import torch.distributed as dist
import torch.multiprocessing as mp

def rank(r, world_size):
    dist.init_process_group("gloo", rank=r, world_size=world_size, timeout=timedelta(seconds=60))
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    mp.spawn(rank, args=(int(sys.argv[1]),), nprocs=int(sys.argv[1]), join=True)
"""


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed with exit {result.returncode}:\n{result.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--file", default="solutions/03_train.py")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()

    floor_script = ROOT / "benchmarks" / ".floor_spawn_init.py"
    floor_script.write_text(FLOOR)
    grade_cmd = [sys.executable, "-m", "grader", args.file]
    floor_cmd = [sys.executable, str(floor_script), str(args.world_size)]
    try:
        timed(floor_cmd), timed(grade_cmd)  # warm the file cache
        floors, grades = [], []
        for _ in range(args.repeat):
            floors.append(timed(floor_cmd))
            grades.append(timed(grade_cmd))
    finally:
        floor_script.unlink(missing_ok=True)

    floor, grade = statistics.median(floors), statistics.median(grades)
    print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    print(f"{'what':58} {'median s':>9} {'min s':>7} {'ratio':>6}")
    print(f"{'floor: spawn ' + str(args.world_size) + ' ranks, gloo init, destroy':58} "
          f"{floor:9.2f} {min(floors):7.2f} {1.0:6.2f}")
    print(f"{'ddp-grade ' + args.file:58} {grade:9.2f} {min(grades):7.2f} {grade / floor:6.2f}")
    print(f"target: ratio <= 1.5 -> {'met' if grade / floor <= 1.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
