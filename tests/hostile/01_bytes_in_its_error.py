"""Sends the grader its own error report, in the grader's format, whose details hold bytes, sets and a
NaN where the grader's own hold text and numbers (a rendezvous at a bytes address, a set of ports): the
report is still a report, in text and in JSON, and the file fails."""
# expect-status: failed
# expect-problem: waited b'7' s in init_process_group
# expect-absent: Traceback

import math
import os
import sys

import torch.distributed as dist

DETAILS = {"addr": b"\xff\x00host", "port": {29500, 29501}, "waited_s": b"7", "grader_addr": frozenset({b"a"}),
           "grader_port": math.nan, "source": b"environment"}


def _line_to_the_grader():
    """The rank's own module that holds its line to the grader, whatever it is called."""
    for module in list(sys.modules.values()):
        if getattr(module, "_CONN", None) is not None and callable(getattr(module, "send", None)):
            return module
    return None


def setup_ddp(rank: int, world_size: int, backend: str | None = None) -> None:
    module = _line_to_the_grader()
    if module is not None:
        module.send(module._CONN, {"status": "error", "error": {
            "type": "RendezvousStuck", "phase": "rendezvous", "message": "waited", "traceback": "", "where": None,
            "rendezvous": DETAILS, "details": {b"key": {b"x"}, "nested": [b"y", {2, 3}, (b"z",)]}}})
        os._exit(1)
    raise RuntimeError("no line to the grader found")


def cleanup_ddp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
