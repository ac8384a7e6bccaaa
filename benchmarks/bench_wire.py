"""Reading a rank's report in the grader: grader.rank.wire beside torch.save + torch.load(weights_only=True),
which it replaced, on reports shaped like those of exercises 02 and 03. Both sides are timed (the
rank writes, the grader reads); the medians are printed side by side in one run.

    python benchmarks/bench_wire.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grader.rank import wire  # noqa: E402


def reports() -> dict:
    """Reports of the sizes the exercises send: one 02 worker answer, one 03 rank's observations."""
    shard = {"status": "ok", "result": {"items": torch.arange(300), "sizes": list(range(7 * 4)), "odd": []}}
    step = {"x": torch.randn(8, 16), "indices": list(range(8)), "loss": 0.5}
    train = {"status": "ok", "result": {
        "events": [dict(step, kind="forward", epoch=e, step=s) for e in range(3) for s in range(3)],
        "params": {f"layer{i}.weight": torch.randn(16, 16) for i in range(3)},
        "returned": {"is_ddp": False, "is_built_model": True, "type": "Sequential"},
    }}
    return {"02 worker answer": shard, "03 rank report": train}


def torch_round_trip(payload) -> object:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def wire_round_trip(payload) -> object:
    return wire.loads(wire.dumps(payload))


def median_ms(fn, payload, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn(payload)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    print(f"{'report':<20} {'torch.save + load(weights_only)':>32} {'grader.rank.wire':>12} {'ratio':>7}")
    for name, payload in reports().items():
        assert str(wire_round_trip(payload)) == str(torch_round_trip(payload))
        before = median_ms(torch_round_trip, payload, args.repeat)
        after = median_ms(wire_round_trip, payload, args.repeat)
        print(f"{name:<20} {before:>29.3f} ms {after:>9.3f} ms {after / before:>7.2f}")


if __name__ == "__main__":
    main()
