"""How long a rank takes to connect to the grader's store, with glibc's resolver defaults and with
the options every grading process gets (harness.RESOLVER_OPTIONS), side by side in one run.

Each connection is what a rank does in init_process_group: a fresh process (from a warm
forkserver) opens a TCPStore client to a store this process holds on 127.0.0.1. c10d names the
peer of every such connection with a reverse DNS lookup; where the DNS server drops a query,
glibc's default waits 5 s before asking again. The table shows how often a connection stalls
and what the stalls cost.

    python benchmarks/bench_connect.py [--rounds 60] [--ranks 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grader.rank import harness  # noqa: E402

STALL_S = 0.5  # a connection slower than this counts as stalled


def connect(port: int, results) -> None:
    from torch.distributed import TCPStore

    started = time.monotonic()
    TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=timedelta(seconds=30))
    results.put(time.monotonic() - started)


def measure(rounds: int, ranks: int) -> list[float]:
    """Connection times of ``rounds`` x ``ranks`` fresh processes to a store this process holds."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    from torch.distributed import TCPStore

    times: list[float] = []
    for _ in range(rounds):
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        results = ctx.Queue()
        processes = [ctx.Process(target=connect, args=(store.port, results)) for _ in range(ranks)]
        for p in processes:
            p.start()
        for p in processes:
            p.join()
        times += [results.get() for _ in processes]
        del store
    return times


def measured_in_a_fresh_process(res_options: str | None, rounds: int, ranks: int) -> list[float]:
    """``measure`` in a new interpreter whose RES_OPTIONS is as given (None: unset): glibc reads it
    once per process, and the store's own side of each connection looks names up too."""
    env = dict(os.environ)
    env.pop("RES_OPTIONS", None)
    if res_options is not None:
        env["RES_OPTIONS"] = res_options
    out = subprocess.run([sys.executable, __file__, "--measure", "--rounds", str(rounds), "--ranks", str(ranks)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def row(label: str, times: list[float]) -> str:
    stalled = [t for t in times if t > STALL_S]
    return (f"{label:<34} {len(times):>6} {statistics.median(times) * 1000:>9.1f} ms {max(times):>7.2f} s "
            f"{len(stalled):>8} {sum(stalled):>9.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.rounds, args.ranks)))
        return
    default = measured_in_a_fresh_process(None, args.rounds, args.ranks)
    bounded = measured_in_a_fresh_process(harness.RESOLVER_OPTIONS, args.rounds, args.ranks)
    print(f"{os.cpu_count()} CPUs; a connection over {STALL_S} s counts as stalled")
    print(f"{'resolver options':<34} {'conns':>6} {'median':>12} {'max':>9} {'stalled':>8} {'stall time':>11}")
    print(row("glibc defaults (RES_OPTIONS unset)", default))
    print(row(f"grader's: {harness.RESOLVER_OPTIONS}", bounded))


if __name__ == "__main__":
    main()
