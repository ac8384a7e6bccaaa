"""Exercise 04's verdicts: each launch's calls, ports, refusals and preset environment, find_free_port,
launch_from_env called directly and under torchrun (pure functions of the records)."""

from __future__ import annotations

from grader.catalog import CLAIM
from grader.rank.drivers.ex04_launch import DIRECT_ENV, EXTRA_ARGS, GOOD_ADDRESSES, PRESET_ADDR


def _args(values: list) -> str:
    return "(" + ", ".join(repr(v) for v in values) + ("," if len(values) == 1 else "") + ")"


def _raised(launch: dict) -> str:
    return f" (launch_distributed raised {launch['error']})" if launch["error"] else ""


def check_launches(g, launches: list[tuple[str, int, dict]], world_size: int, counted=None) -> None:
    """spawns-processes, passes-args and waits-for-all, for every launch of record_rank. What the records say
    names a wrong launch (a claim); what decides spawns-processes is what the kernel counted (``counted``, a
    grader.traffic.RunTraffic of the callers' run, launch i made by caller i): world_size processes that caller
    started, each of which let the grader read its sockets and sent the others bytes (they met in a group).
    Where the counters cannot be read, the records alone decide, as a claim."""
    if not any(launch["records"] for _, _, launch in launches):
        errors = "; ".join(f"{who}{_raised(launch)}" for who, _, launch in launches if launch["error"])
        for check_id in ("passes-args", "waits-for-all"):
            g.record(check_id, False, "fn never ran in any launch, so there is nothing to check"
                     + (f" ({errors})" if errors else ""), world_size=world_size)
    for caller, (who, caller_pid, launch) in enumerate(launches):
        records = launch["records"]
        ranks = sorted(r["received"][0] if r["received"] else None for r in records)
        ranks_text = ", ".join(repr(r) for r in ranks) or "none"
        if ranks != list(range(world_size)):
            g.record("spawns-processes", False,
                     f"{who}: fn ran {len(records)} time(s), as rank(s) {ranks_text}; expected each rank "
                     f"0..{world_size - 1} exactly once{_raised(launch)}", world_size=world_size, evidence=CLAIM)
        in_caller = [r for r in records if r["pid"] == caller_pid]
        if in_caller:
            g.record("spawns-processes", False,
                     f"{who}: fn ran in the caller's own process (pid {caller_pid}) for rank(s) "
                     f"{', '.join(repr(r['received'][0]) for r in in_caller)}: every rank needs a new process",
                     world_size=world_size, evidence=CLAIM)
        pids = [r["pid"] for r in records]
        if len(set(pids)) != len(pids):
            g.record("spawns-processes", False, f"{who}: several ranks ran in one process (pids {pids})",
                     world_size=world_size, evidence=CLAIM)
        _check_started(g, who, caller, counted, world_size)

        expected_tail = [world_size, *EXTRA_ARGS]
        for r in sorted(records, key=lambda r: str(r["received"][:1])):
            if r["received"][1:] != expected_tail:
                rank = r["received"][0] if r["received"] else None
                g.record("passes-args", False,
                         f"{who}: launch_distributed(fn, {world_size}, {', '.join(map(repr, EXTRA_ARGS))}) "
                         f"called fn{_args(r['received'])}; expected fn{_args([rank, *expected_tail])}",
                         rank=rank if isinstance(rank, int) else None, world_size=world_size)
                break
        g.record("passes-args", True)

        late = [r for r in records if r["end"] > launch["returned"]]
        if late:
            r = max(late, key=lambda r: r["end"])
            g.record("waits-for-all", False,
                     f"{who}: launch_distributed returned {r['end'] - launch['returned']:.2f} s before "
                     f"rank {r['received'][0] if r['received'] else '?'} finished "
                     f"({len(late)} of {len(records)} rank(s) were still running)", world_size=world_size)
        g.record("waits-for-all", True)


def _check_started(g, who: str, caller: int, counted, world_size: int) -> None:
    """spawns-processes on the kernel's count: the processes caller ``caller`` started that met."""
    if counted is None:
        g.record("spawns-processes", True, evidence=CLAIM)
        return
    started = counted.spawned.get(caller, {})
    met = [pid for pid, sent in started.items() if sent > 0 or world_size == 1]
    if len(met) < world_size:
        g.record("spawns-processes", False,
                 f"{who}: the kernel saw {len(met)} process(es) that this launch started meet the others in a group "
                 f"(each let the grader read its sockets and sent the others bytes), expected {world_size}: fn must "
                 f"run in {world_size} new processes, each joining the group through MASTER_ADDR and MASTER_PORT",
                 world_size=world_size)
        return
    g.record("spawns-processes", True)


def check_free_port(g, launches: list[dict], caller_pids: list[int], world_size: int) -> None:
    """Two launches at the same moment, addresses left unset: each needs a port of its own."""
    ports = []
    for i, launch in enumerate(launches):
        seen = sorted({(r["master_addr"], r["master_port"]) for r in launch["records"]}, key=str)
        if not seen:
            g.record("free-port", False, f"caller {i}: no rank of the launch recorded anything{_raised(launch)}",
                     world_size=world_size)
            return
        if len(seen) > 1:
            g.record("free-port", False, f"caller {i}: the ranks of one launch saw different addresses: "
                     + ", ".join(f"{a}:{p}" for a, p in seen), world_size=world_size)
            return
        addr, port = seen[0]
        if addr not in GOOD_ADDRESSES or port is None or not str(port).isdigit():
            g.record("free-port", False, f"caller {i}: with MASTER_ADDR and MASTER_PORT unset before the call, "
                     f"fn saw MASTER_ADDR={addr} MASTER_PORT={port}; expected 127.0.0.1 and a port number",
                     world_size=world_size)
            return
        ports.append(port)
    if ports[0] == ports[1]:
        problems = [f"caller {i}'s launch: {problem}" for i, l in enumerate(launches)
                    if (problem := _meeting_problem(l, caller_pids[i], world_size))]
        g.record("free-port", False, f"two launches started at the same moment both used MASTER_PORT={ports[0]}, "
                 "so they collide" + (f" ({'; '.join(problems)})" if problems else
                                      " (this time one happened to finish before the other met)"),
                 world_size=world_size)
        return
    for i, launch in enumerate(launches):
        problem = _meeting_problem(launch, caller_pids[i], world_size)
        if problem:
            g.record("free-port", False, f"caller {i}'s launch on port {ports[i]} (the other used "
                     f"{ports[1 - i]}): {problem}", world_size=world_size)
            return
    g.record("free-port", True)


def check_find_free_port(g, found: dict) -> None:
    """find_free_port() itself: an int (not a str, which only works where it is put into os.environ),
    a TCP port number, that a socket could bind right after the call."""
    if found["missing"]:
        g.record("find-free-port", False, "the file has no find_free_port(): the statement asks for it, "
                 "returning a free TCP port as an int")
        return
    for i, call in enumerate(found["calls"]):
        which = f"call {i + 1} of {len(found['calls'])}" if i else "the first call"
        if call["error"]:
            g.record("find-free-port", False, f"find_free_port() raised {call['error']} ({which})")
            return
        if call["type"] != "int":
            hint = ""
            if call["type"] == "str":
                hint = (": a str works only where it goes into os.environ; socket.bind(('127.0.0.1', port)) "
                        "and TCPStore(port=...) need an int")
            g.record("find-free-port", False, f"find_free_port() returned {call['value']}, a {call['type']}, "
                     f"not an int{hint}")
            return
        port = int(call["value"])
        if not 0 < port < 65536:
            g.record("find-free-port", False, f"find_free_port() returned {port}, which is not a TCP port "
                     "number (1 to 65535)")
            return
        if call["bind_error"]:
            g.record("find-free-port", False, f"find_free_port() returned {port}, but right after the call a "
                     f"socket could not bind 127.0.0.1:{port} ({call['bind_error']}): the port is in use "
                     f"({which})")
            return
    g.record("find-free-port", True)


def _meeting_problem(launch: dict, caller_pid: int, world_size: int) -> str | None:
    """Why the ranks of one launch did not form their own group, or None."""
    launch_id = None
    for r in launch["records"]:
        if r["pid"] == caller_pid:
            continue  # spawns-processes says so
        rank = r["received"][0] if r["received"] else None
        if r["group_error"]:
            return f"rank {rank} could not join the group: {r['group_error']}"
        members = sorted(tuple(p) for p in r["peers"])
        launch_id = members[0][0] if launch_id is None else launch_id
        if {m[0] for m in members} != {launch_id} or [m[1] for m in members] != list(range(world_size)):
            met = ", ".join(f"rank {m[1]} of caller {m[0] - 1}" for m in members)
            return f"rank {rank}'s group was {{{met}}}: it met processes of the other launch"
    if launch["error"]:
        return f"launch_distributed raised {launch['error']}"
    return None


def check_raises(g, launch: dict, world_size: int) -> None:
    last = world_size - 1
    ranks = sorted(str(r["received"][0]) for r in launch["records"] if r["received"])
    if str(last) not in ranks:
        g.record("raises-on-failure", False, f"the launch of a fn that raises in rank {last} never ran rank "
                 f"{last} (ranks that ran: {', '.join(ranks) or 'none'}){_raised(launch)}", world_size=world_size)
    elif launch["error"] is None:
        g.record("raises-on-failure", False, f"rank {last} raised RuntimeError, but launch_distributed returned "
                 "normally: the caller never learns that the job failed", world_size=world_size)
    else:
        g.record("raises-on-failure", True)


def check_preset(g, launch: dict, preset_port, world_size: int) -> None:
    for r in launch["records"]:
        rank = r["received"][0] if r["received"] else None
        seen, wanted = (r["master_addr"], r["master_port"]), (PRESET_ADDR, str(preset_port))
        if seen != wanted:
            g.record("keeps-set-port", False,
                     f"MASTER_ADDR={wanted[0]} and MASTER_PORT={wanted[1]} were set before the call, but "
                     f"rank {rank} saw MASTER_ADDR={seen[0]} MASTER_PORT={seen[1]}",
                     rank=rank if isinstance(rank, int) else None, world_size=world_size)
            return
    if not launch["records"]:
        g.record("keeps-set-port", False, f"no rank recorded anything{_raised(launch)}", world_size=world_size)
        return
    g.record("keeps-set-port", True)


def check_direct(g, direct: dict) -> None:
    env = ", ".join(f"{k}={v}" for k, v in DIRECT_ENV.items() if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    expected = [int(DIRECT_ENV["RANK"]), int(DIRECT_ENV["WORLD_SIZE"])]
    if direct["error"]:
        g.record("rank-from-RANK", False, f"with {env}, launch_from_env raised {direct['error']}; it should "
                 "call fn(rank, world_size) once, in the process it runs in")
    elif direct["calls"] != [expected]:
        got = ", ".join(f"fn{_args(c)}" for c in direct["calls"]) or "fn was never called"
        g.record("rank-from-RANK", False, f"with {env}, launch_from_env called {got}; expected fn{_args(expected)}")
    else:
        g.record("rank-from-RANK", True)


def check_torchrun(g, run: dict, world_size: int) -> None:
    where = f"torchrun --standalone --nproc_per_node={world_size}"
    tail = "\n".join(run["output"].rstrip().splitlines()[-6:])
    if run["errors"]:
        g.record("torchrun", False, f"under {where}, launch_from_env raised: {run['errors'][0].strip()}",
                 world_size=world_size)
        return
    if run["returncode"] is None:
        g.record("torchrun", False, f"{where} did not finish within {run['timeout_s']:g} s", world_size=world_size)
        return
    records = run["records"]
    calls = sorted((r["received"] for r in records), key=str)
    expected = [[rank, world_size] for rank in range(world_size)]
    if calls != expected:
        got = ", ".join(f"fn{_args(c)}" for c in calls) or "nothing"
        g.record("torchrun", False, f"under {where}, fn was called as {got}; expected "
                 + ", ".join(f"fn{_args(c)}" for c in expected) + " (one call per torchrun process)",
                 world_size=world_size)
        return
    for r in records:
        if r["received"][0] != int(r["env_rank"]):
            g.record("torchrun", False, f"the torchrun process with RANK={r['env_rank']} called "
                     f"fn{_args(r['received'])}", world_size=world_size)
            return
    if run["returncode"] != 0:
        g.record("torchrun", False, f"{where} exited with code {run['returncode']}:\n{tail}", world_size=world_size)
        return
    g.record("torchrun", True)
