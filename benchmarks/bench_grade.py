"""Time to grade a solution against the floor: a bare spawn, init, destroy of the same world size.

All are timed as whole commands (a fresh Python each time, as a learner runs
them), several times; the medians are printed side by side:
- the floor: spawn the ranks, gloo init, destroy;
- the solution run once, plainly: `mp.spawn` of 03's `train_ddp` on the grader's model and data
  (only for 03, the default file): what a learner's own test script costs;
- a cold grading (`--no-server`: this command's own pool, torch imported in it);
- a warm grading: the same command once the background grading server is up (the
  first grading of a session of work starts it).

    python benchmarks/bench_grade.py [--repeat 5] [--file solutions/03_train.py] [--world-size 2]

The grader runs each exercise at its default world sizes (03: 2 and 3, at once), so
it does more than the floor; the target is a ratio of at most 1.5.
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


SOLUTION_ONCE = r"""
import importlib.util, os, socket, sys, tempfile
import torch.multiprocessing as mp
from grader.checks import ex03_train as ex

spec = importlib.util.spec_from_file_location("solution", sys.argv[1])
solution = importlib.util.module_from_spec(spec); spec.loader.exec_module(solution)

def rank(r, world_size, path):
    solution.train_ddp(r, world_size, model_fn=ex.TinyNet,
                       dataset=ex.make_dataset(world_size * ex.BATCH_SIZE * ex.STEPS_PER_EPOCH),
                       epochs=ex.EPOCHS, batch_size=ex.BATCH_SIZE, lr=ex.LR, checkpoint_path=path)

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank, args=(int(sys.argv[2]), os.path.join(d, "ckpt.pt")), nprocs=int(sys.argv[2]), join=True)
"""


def _wait_for_server(env: dict, seconds: float = 120) -> None:
    check = [sys.executable, "-c", "import sys; from grader import server; sys.exit(0 if server.status()['running'] else 1)"]
    deadline = time.monotonic() + seconds
    while subprocess.run(check, env=env, cwd=ROOT).returncode != 0:
        if time.monotonic() > deadline:
            sys.exit("the grading server did not come up")
        time.sleep(0.5)
    time.sleep(2)  # let it finish importing what the ranks use


def timed(cmd: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
    grade_cmd = [sys.executable, "-m", "grader", args.file, "--no-server"]
    warm_cmd = [sys.executable, "-m", "grader", args.file]
    floor_cmd = [sys.executable, str(floor_script), str(args.world_size)]
    once_script = ROOT / "benchmarks" / ".solution_once.py"
    once_script.write_text(SOLUTION_ONCE)
    once_cmd = [sys.executable, str(once_script), str(ROOT / args.file), str(args.world_size)]
    with_once = Path(args.file).name == "03_train.py"
    state = tempfile.mkdtemp(prefix="bench-", dir="/tmp")
    warm_env = {**os.environ, "DDP_GRADE_SERVER": "1", "DDP_GRADE_STATE_DIR": state}
    try:
        timed(floor_cmd), timed(grade_cmd)  # warm the file cache
        floors, grades, warms, onces = [], [], [], []
        for _ in range(args.repeat):
            floors.append(timed(floor_cmd))
            grades.append(timed(grade_cmd))
            if with_once:
                onces.append(timed(once_cmd, {**os.environ, "PYTHONPATH": str(ROOT)}))
        timed(warm_cmd, warm_env)  # cold, and starts the server
        _wait_for_server(warm_env)
        for _ in range(args.repeat):
            warms.append(timed(warm_cmd, warm_env))
    finally:
        floor_script.unlink(missing_ok=True)
        once_script.unlink(missing_ok=True)
        subprocess.run([sys.executable, "-c", "from grader import server; server.stop()"], env=warm_env, cwd=ROOT)
        shutil.rmtree(state, ignore_errors=True)

    floor, grade = statistics.median(floors), statistics.median(grades)
    print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    print(f"{'what':58} {'median s':>9} {'min s':>7} {'ratio':>6}")
    print(f"{'floor: spawn ' + str(args.world_size) + ' ranks, gloo init, destroy':58} "
          f"{floor:9.2f} {min(floors):7.2f} {1.0:6.2f}")
    if onces:
        once = statistics.median(onces)
        print(f"{'mp.spawn of the solution once (' + str(args.world_size) + ' ranks, same model and data)':58} "
              f"{once:9.2f} {min(onces):7.2f} {once / floor:6.2f}")
    warm = statistics.median(warms)
    print(f"{'ddp-grade ' + args.file + ' --no-server (cold)':58} {grade:9.2f} {min(grades):7.2f} {grade / floor:6.2f}")
    print(f"{'ddp-grade ' + args.file + ' (warm: grading server up)':58} {warm:9.2f} {min(warms):7.2f} "
          f"{warm / floor:6.2f}")
    print(f"targets: cold ratio <= 1.5 -> {'met' if grade / floor <= 1.5 else 'NOT met'}; "
          f"warm <= 0.8 s -> {'met' if warm <= 0.8 else 'NOT met'}")


if __name__ == "__main__":
    main()
