"""Exercise 04: launch_distributed / launch_from_env.

Rank side: the grader starts three callers. Callers 0 and 1 call the learner's
launch_distributed at the same moment with ``record_rank``, which writes down,
in every process it runs in, what it received and saw (args, pid,
MASTER_ADDR / MASTER_PORT, start and end time) and whom it met in a gloo group
joined through those variables. Caller 2 calls launch_from_env in its own
process with RANK != LOCAL_RANK, starts a real torchrun on a script that calls
launch_from_env, and meanwhile launches a fn that fails in its last rank with
MASTER_ADDR / MASTER_PORT already set. Caller 2 also calls find_free_port
itself a few times and, right after each call, tries to bind what it returned.
Grader side: every verdict is decided from those records, but spawns-processes,
which stands on what the kernel counted: the processes each caller started that
let the grader read their sockets and met (grader.traffic).
"""

from __future__ import annotations

import socket

from grader.rank.drivers.ex04_launch import UNSET, main
from grader.checks.ex04_launch.verdicts import (check_direct, check_find_free_port, check_free_port, check_launches,
                                                check_preset, check_raises, check_torchrun)
from grader.checks.interface import Grader


def grade(g: Grader) -> None:
    world_size = g.world_sizes[0]
    preset_port = _free_port()
    outcome = g.run(main, 3, kwargs={"world_size": world_size, "preset_port": preset_port}, env=UNSET,
                    label=f"two launches at once, then torchrun (world size {world_size} each; 15-20 s)",
                    graded_size=world_size, traffic=True)
    callers = outcome.results()
    concurrent, pids, last = [c["concurrent"] for c in callers[:2]], [c["caller_pid"] for c in callers[:2]], callers[2]
    check_launches(g, [(f"caller {i}", pids[i], launch) for i, launch in enumerate(concurrent)], world_size,
                   outcome.traffic)
    check_free_port(g, concurrent, pids, world_size)
    check_find_free_port(g, last["find_free_port"])
    check_raises(g, last["failing"], world_size)
    check_preset(g, last["failing"], preset_port, world_size)
    if last["direct"].get("not_implemented"):
        g.not_implemented("launch_from_env")
    check_direct(g, last["direct"])
    check_torchrun(g, last["torchrun"], world_size)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
