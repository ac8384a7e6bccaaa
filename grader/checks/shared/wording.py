"""Words for what happened to a process, the same in every report (the report and the checks use them)."""

from __future__ import annotations

import signal


def describe_exit(code: int | None, limit_detail: str = "") -> str:
    """"was killed by SIGSEGV", "exited with code 3", "was stopped at the memory limit (...)", "ended"."""
    if limit_detail:
        return f"was stopped at {limit_detail}"
    if code is None:
        return "ended"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
