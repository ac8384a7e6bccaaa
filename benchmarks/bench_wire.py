"""What the grader's reading of what ranks send costs, side by side in one run:

* a rank's report, written in the rank and read in the grader, on reports shaped like those the exercises
  send (02's worker answer, a 03 rank's observations, 36's largest report, a long timeline): grader.rank.wire
  (a JSON header and raw tensor bytes, read within limits) beside the pickle with an allowlist it replaced
  and beside torch.save + torch.load(weights_only=True);
* a checkpoint a rank saved, read by the grader: grader.rank.untrusted's checked load (the zip's records and
  the pickle's instructions read first, torch.load on a zip the grader wrote, every tensor checked after)
  beside torch.load(weights_only=True) alone, for 03's model and for a model of 10 MB with AdamW's state.

The medians of --repeat runs each, in milliseconds.

    python benchmarks/bench_wire.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import io
import math
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grader.rank import checkpoints, wire  # noqa: E402


def reports() -> dict:
    """Reports of the sizes the exercises send."""
    shard = {"status": "ok", "result": {"items": torch.arange(300), "sizes": list(range(7 * 4)), "odd": []}}
    step = {"x": torch.randn(8, 16), "indices": list(range(8)), "loss": 0.5}
    train = {"status": "ok", "result": {
        "events": [dict(step, kind="forward", epoch=e, step=s) for e in range(3) for s in range(3)],
        "params": {f"layer{i}.weight": torch.randn(16, 16) for i in range(3)},
        "returned": {"is_ddp": False, "is_built_model": True, "type": "Sequential"},
    }}
    hybrid = {"status": "ok", "result": {f"p{i}": {"w": torch.randn(64, 16), "steps": [(j, 0.5) for j in range(5)]}
                                         for i in range(288)}}  # 36's largest: 288 tensors, 1.2 MB
    timeline = {"status": "ok", "result": {"timeline": [
        {"kind": "region", "name": f"step {i}", "t0": 0.1 * i, "t1": 0.1 * i + 0.05, "rank": 1, "bytes": 4096}
        for i in range(3000)]}}
    return {"02 worker answer": shard, "03 rank report": train, "36 rank report": hybrid, "timeline": timeline}


class _PickleWriter(pickle.Pickler):
    """The report as the grader read it before: a pickle, each tensor as its dtype, shape and bytes."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().reshape(-1).contiguous()
            return _tensor, (str(obj.dtype)[6:], tuple(obj.shape), flat.view(torch.uint8).numpy().tobytes())
        return NotImplemented


def _tensor(dtype: str, shape: tuple, data: bytes) -> torch.Tensor:
    kind = getattr(torch, dtype)
    if len(data) != math.prod(shape) * kind.itemsize:
        raise pickle.UnpicklingError("size")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape) if data else \
        torch.empty(shape, dtype=kind)


class _PickleReader(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == (__name__, "_tensor"):
            return _tensor
        raise pickle.UnpicklingError(f"{module}.{name}")


def pickle_round_trip(payload) -> object:
    buffer = io.BytesIO()
    _PickleWriter(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return _PickleReader(io.BytesIO(buffer.getvalue())).load()


def torch_round_trip(payload) -> object:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def wire_round_trip(payload) -> object:
    return wire.loads(wire.dumps(payload))


def checkpoints_saved() -> dict[str, bytes]:
    small = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    large = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(10)])
    optimizer = torch.optim.AdamW(large.parameters())
    large(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    out = {}
    for name, state in (("03 model", small.state_dict()),
                        ("10 MB + AdamW", {"model": large.state_dict(), "optimizer": optimizer.state_dict(),
                                           "epoch": 3})):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        out[name] = buffer.getvalue()
    return out


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
    torch.set_num_threads(1)  # as the grader runs
    print(f"{'report':<18} {'bytes':>10} {'torch.save+load':>16} {'pickle':>10} {'grader wire':>12} "
          f"{'wire/pickle':>12}")
    for name, payload in reports().items():
        assert str(wire_round_trip(payload)) == str(pickle_round_trip(payload))
        size = len(wire.dumps(payload))
        before = median_ms(torch_round_trip, payload, args.repeat)
        pickled = median_ms(pickle_round_trip, payload, args.repeat)
        after = median_ms(wire_round_trip, payload, args.repeat)
        print(f"{name:<18} {size:>10,} {before:>13.3f} ms {pickled:>7.3f} ms {after:>9.3f} ms {after / pickled:>12.2f}")
    print()
    print(f"{'checkpoint':<18} {'bytes':>10} {'torch.load(weights_only)':>25} {'checked load':>13} {'ratio':>7}")
    for name, data in checkpoints_saved().items():
        plain = median_ms(lambda d: torch.load(io.BytesIO(d), weights_only=True), data, args.repeat)
        checked = median_ms(checkpoints.load, data, args.repeat)
        print(f"{name:<18} {len(data):>10,} {plain:>22.3f} ms {checked:>10.3f} ms {checked / plain:>7.2f}")


if __name__ == "__main__":
    main()
