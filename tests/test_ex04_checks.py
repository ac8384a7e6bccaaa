"""Exercise 04's verdicts, decided from hand-made records (no processes started)."""

from __future__ import annotations

import pytest

from grader.rank.drivers import ex04_launch as rank_side
from grader.checks.ex04_launch import verdicts as v
from grading_helpers import grading_for, verdicts

WS = 2
CALLER_PIDS = [100, 200]


grading = grading_for("04", WS)


def launch(caller: int, port: str = None, *, returned: float = 10.0, pids=None, received=None, error=None,
           launch_id=None) -> dict:
    launch_id = caller + 1 if launch_id is None else launch_id
    pids = pids or [1000 * (caller + 1) + r for r in range(WS)]
    records = []
    for rank in range(WS):
        records.append({
            "received": received[rank] if received else [rank, WS, *rank_side.EXTRA_ARGS],
            "pid": pids[rank], "caller_pid": CALLER_PIDS[caller],
            "master_addr": "127.0.0.1", "master_port": port or str(40000 + caller),
            "start": 1.0, "end": 2.0, "group_error": None,
            "peers": [[launch_id, r] for r in range(WS)],
        })
    return {"started": 0.0, "returned": returned, "error": error, "records": records}


def decide(launches: list[dict]) -> dict:
    g = grading()
    v.check_launches(g, [(f"caller {i}", CALLER_PIDS[i], l) for i, l in enumerate(launches)], WS)
    v.check_free_port(g, launches, CALLER_PIDS, WS)
    return verdicts(g)


def test_good_records_pass():
    got = decide([launch(0), launch(1)])
    assert {k: v[0] for k, v in got.items()} == {k: "pass" for k in
                                                   ("spawns-processes", "passes-args", "waits-for-all", "free-port")}


def test_same_port_fails_free_port_and_names_it():
    status, message = decide([launch(0, "29500"), launch(1, "29500")])["free-port"]
    assert status == "fail" and "29500" in message


def test_cross_connected_groups_fail_free_port():
    crossed = launch(1)
    crossed["records"][0]["peers"] = [[1, 0], [2, 0]]
    status, message = decide([launch(0), crossed])["free-port"]
    assert status == "fail" and "other launch" in message


def test_rank_in_the_caller_fails_spawns_processes():
    status, message = decide([launch(0, pids=[CALLER_PIDS[0], CALLER_PIDS[0]]), launch(1)])["spawns-processes"]
    assert status == "fail" and str(CALLER_PIDS[0]) in message


def test_missing_rank_fails_spawns_processes():
    short = launch(0)
    short["records"].pop()
    assert decide([short, launch(1)])["spawns-processes"][0] == "fail"


def test_late_rank_fails_waits_for_all():
    status, message = decide([launch(0, returned=1.5), launch(1)])["waits-for-all"]
    assert status == "fail" and "0.50 s" in message


def test_args_without_world_size_fail_passes_args():
    received = [[r, *rank_side.EXTRA_ARGS] for r in range(WS)]
    status, message = decide([launch(0, received=received), launch(1)])["passes-args"]
    assert status == "fail" and "fn(0, 'ddp-grade', 7)" in message


@pytest.mark.parametrize("error, ok", [(None, False), ("ProcessRaisedException: boom", True)])
def test_raises_on_failure(error, ok):
    g = grading()
    v.check_raises(g, launch(0, error=error), WS)
    assert verdicts(g)["raises-on-failure"][0] == ("pass" if ok else "fail")


def test_preset_port_overwritten_fails():
    g = grading()
    preset = launch(0)
    for r in preset["records"]:
        r["master_addr"] = rank_side.PRESET_ADDR
    v.check_preset(g, preset, 40001, WS)
    status, message = verdicts(g)["keeps-set-port"]
    assert status == "fail" and "40001" in message and "40000" in message


@pytest.mark.parametrize("calls, ok", [([[3, 4]], True), ([[1, 4]], False), ([], False), ([[3, 4], [3, 4]], False)])
def test_rank_from_RANK(calls, ok):
    g = grading()
    v.check_direct(g, {"calls": calls, "error": None})
    assert verdicts(g)["rank-from-RANK"][0] == ("pass" if ok else "fail")


def torchrun_run(received, returncode=0) -> dict:
    return {"returncode": returncode, "timeout_s": 30.0, "output": "", "errors": [],
            "records": [{"received": r, "env_rank": str(r[0])} for r in received]}


@pytest.mark.parametrize("received, returncode, ok", [
    ([[0, 2], [1, 2]], 0, True),
    ([[0, 2], [0, 2], [1, 2], [1, 2]], 0, False),
    ([[0, 2], [1, 2]], 1, False),
    ([[0, 2], [1, 2]], None, False),
])
def test_torchrun(received, returncode, ok):
    g = grading()
    v.check_torchrun(g, torchrun_run(received, returncode), WS)
    assert verdicts(g)["torchrun"][0] == ("pass" if ok else "fail")


def test_no_records_at_all_pass_nothing():
    empty = [dict(launch(i), records=[], error="RuntimeError: boom") for i in range(2)]
    got = decide(empty)
    assert all(got[c][0] == "fail" for c in ("spawns-processes", "passes-args", "waits-for-all", "free-port"))
    assert "boom" in got["passes-args"][1]


def port_call(value, type_name=None, error=None, bind_error=None) -> dict:
    return {"type": type_name or type(value).__name__, "value": repr(value), "error": error, "bind_error": bind_error}


@pytest.mark.parametrize("calls, ok, words", [
    ([port_call(40000), port_call(40001)], True, ""),
    ([port_call("40000")], False, "a str, not an int"),
    ([port_call(40000), port_call(40001.0)], False, "a float, not an int"),
    ([port_call(True)], False, "a bool, not an int"),
    ([port_call(70000)], False, "not a TCP port number"),
    ([port_call(0)], False, "not a TCP port number"),
    ([port_call(40000, bind_error="OSError: [Errno 98] Address already in use")], False, "could not bind"),
    ([{"type": None, "value": None, "error": "NotImplementedError: ", "bind_error": None}], False, "raised"),
])
def test_find_free_port(calls, ok, words):
    g = grading()
    v.check_find_free_port(g, {"missing": False, "calls": calls})
    status, message = verdicts(g)["find-free-port"]
    assert status == ("pass" if ok else "fail") and words in message


def test_a_missing_find_free_port_fails():
    g = grading()
    v.check_find_free_port(g, {"missing": True, "calls": []})
    assert verdicts(g)["find-free-port"][0] == "fail"


class _Context:
    def __init__(self, find_free_port):
        self.module = type("Learner", (), {"find_free_port": staticmethod(find_free_port)})

    def learner(self):
        return self.module


def test_the_port_is_bound_right_after_each_call():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        found = rank_side._call_find_free_port(_Context(lambda: busy))
        assert [c["type"] for c in found["calls"]] == ["int"] * rank_side.FIND_PORT_CALLS
        assert all(c["bind_error"] for c in found["calls"])

    def free():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    found = rank_side._call_find_free_port(_Context(free))
    assert not any(c["bind_error"] or c["error"] for c in found["calls"])
    found = rank_side._call_find_free_port(_Context(lambda: str(free())))
    assert found["calls"][0]["type"] == "str" and found["calls"][0]["bind_error"] is None


def test_spawned_counts_what_each_process_a_rank_started_sent_its_siblings():
    """Two callers (pids 100 and 200, ranks 0 and 1); caller 0 started 11 and 12, which met; caller 1 started 21,
    which met only a process of caller 0, and 22 and 23 (23 a child of 22), whose one connection to 21 both
    hold: a socket two processes hold counts for neither, and a process of another caller is no sibling."""
    from grader import traffic

    t = traffic.Traffic()
    t.ancestry = {100: [1], 200: [1], 11: [100], 12: [100], 21: [200], 22: [200], 23: [22, 200]}

    def connect(cookie: int, a: int, b: int, sent_ab: int, sent_ba: int, holders_a, holders_b) -> None:
        t.sockets[cookie] = traffic.Sock(cookie, 1, ("127.0.0.1", a), ("127.0.0.1", b), 0, None, sent_ba)
        t.sockets[cookie + 1] = traffic.Sock(cookie + 1, 1, ("127.0.0.1", b), ("127.0.0.1", a), 0, None, sent_ab)
        t.holders[cookie], t.holders[cookie + 1] = set(holders_a), set(holders_b)

    connect(10, 5001, 5002, 300, 200, {11}, {12})
    connect(20, 5003, 5004, 50, 60, {21}, {11})
    connect(30, 5005, 5006, 70, 80, {22, 23}, {21})
    spawned = t.spawned({100: 0, 200: 1})
    assert spawned == {0: {11: 300, 12: 200}, 1: {21: 0, 22: 0, 23: 0}}, spawned


def test_spawns_processes_stands_on_the_processes_the_kernel_saw_meet():
    from grader.traffic import RunTraffic

    launches = [launch(0), launch(1)]
    met = RunTraffic(3, {}, 0, {0, 1, 2}, spawned={0: {11: 400, 12: 380}, 1: {21: 400, 22: 380}})
    g = grading()
    v.check_launches(g, [(f"caller {i}", CALLER_PIDS[i], l) for i, l in enumerate(launches)], WS, met)
    assert verdicts(g)["spawns-processes"][0] == "pass"
    assert g.results(None)[0].evidence == "kernel"

    for seen in ({0: {11: 400, 12: 380}}, {0: {11: 400, 12: 380}, 1: {21: 400, 22: 0}}):
        g = grading()
        forged = RunTraffic(3, {}, 0, {0, 1, 2}, spawned=seen)
        v.check_launches(g, [(f"caller {i}", CALLER_PIDS[i], l) for i, l in enumerate(launches)], WS, forged)
        status, message = verdicts(g)["spawns-processes"]
        assert status == "fail" and message.startswith("caller 1: the kernel saw ") and "expected 2" in message

    g = grading()  # no counters: the records decide, as a claim
    v.check_launches(g, [(f"caller {i}", CALLER_PIDS[i], l) for i, l in enumerate(launches)], WS, None)
    assert verdicts(g)["spawns-processes"][0] == "pass"
