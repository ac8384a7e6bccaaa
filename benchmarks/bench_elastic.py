"""How long does grading exercise 15 take, next to the least a torchrun job costs?

One run, on this machine's CPU:
  - the grading of solutions/15_elastic.py (`python -m grader ... --no-server`), which runs
    main() twice as one worker, then two torchrun jobs at once: 2 nodes x 2 with a worker killed
    and all four started again, and 1 node x 4;
  - torch's floor: `torchrun --standalone --nproc-per-node 4` of a script that only joins a gloo
    group, builds a DistributedDataParallel (which imports torch._dynamo, as every worker of the
    exercise does) and leaves.
The grading starts 12 torchrun workers, three rounds of four, so about three times the floor is
what torchrun alone costs it; the rest is the single-worker runs, the restart and the checks.

    python benchmarks/bench_elastic.py [--reps 1]

Not a test: timings depend on the machine and its load (printed with them).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BARE = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
DistributedDataParallel(torch.nn.Linear(2, 2))
dist.destroy_process_group()
"""


def timed(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode not in (0,):
        sys.exit(f"{' '.join(command[:6])} ... exited with {done.returncode}:\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1, help="repetitions of each (the median is shown)")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDP_GRADE_SERVER": "0", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as folder:
        bare = os.path.join(folder, "bare.py")
        Path(bare).write_text(BARE)
        env["DDP_GRADE_STATE_DIR"] = folder
        floor, grading = [], []
        for _ in range(args.reps):
            floor.append(timed([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                                bare], env))
            grading.append(timed([sys.executable, "-m", "grader", str(ROOT / "solutions" / "15_elastic.py"), "-q",
                                  "--no-server"], env))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    f, g = statistics.median(floor), statistics.median(grading)
    print(f"{os.cpu_count()} CPU(s), load average {load:.1f}, median of {args.reps}\n")
    print(f"{'torchrun, 4 workers that join a group and leave (torch floor)':64}{f:>8.1f} s")
    print(f"{'grading exercise 15 (12 torchrun workers, one restart)':64}{g:>8.1f} s")
    print(f"{'ratio':64}{g / f:>8.1f} x   (three rounds of workers: about 3 x)")


if __name__ == "__main__":
    main()
