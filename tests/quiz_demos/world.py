"""Run a demo's driver in a small gloo world on CPU, through the grader's own harness.

The harness gives each run a fresh rendezvous on 127.0.0.1 (a TCPStore it holds, so no port is
hard-coded), a deadline, and each rank's stack and output when something goes wrong. A driver is
``def driver(ctx) -> dict`` in a demo module, named ``"quiz_demos.test_<topic>:<function>"`` (the
ranks import it by that name: ``tests/`` is on the path, put there for ``tests/conftest.py``); it
returns plain data (tensors, numbers, strings, lists, dicts).
"""

from __future__ import annotations

import pytest


def run_world(session, driver: str, world_size: int = 2, timeout_s: float = 120, env: dict | None = None,
              kwargs: dict | None = None) -> list:
    """Every rank's result, in rank order; the test fails with what each rank did when one did not finish."""
    outcome = session.run(driver, world_size, learner_path=__file__, timeout_s=timeout_s, env=env, kwargs=kwargs)
    if not outcome.ok:
        lines = [f"{driver} on {world_size} ranks did not finish (timed out: {outcome.timed_out})"]
        for r in outcome.ranks:
            lines.append(f"rank {r.rank}: {r.status}")
            if r.error:
                lines.append(r.error.get("traceback") or f"{r.error.get('type')}: {r.error.get('message')}")
            if r.stack:
                lines.append(r.stack[-3000:])
            if r.output:
                lines.append(r.output[-2000:])
        pytest.fail("\n".join(lines))
    return outcome.results()
