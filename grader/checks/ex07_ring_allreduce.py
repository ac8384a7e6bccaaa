"""Exercise 07: ring_all_reduce from point-to-point messages.

Rank side: call the learner's ring_all_reduce on a list of seeded tensors (the
same list on every rank, each rank's values drawn from its own seed) while
recording every torch.distributed call it makes. Grader side: rebuild every
rank's tensors from the same seeds, sum them here, and compare; whom each rank
talked to and how many bytes it sent are what the kernel counted on the
connections between the ranks (grader.traffic), the calls each rank recorded
only naming the call that went wrong.
"""

from __future__ import annotations

import torch

from grader.rank import probes
from grader.catalog import CLAIM
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.rank.drivers.ex07_ring_allreduce import BIG_NUMEL, DTYPES, cases_for, drawn_cases, make_tensor, ring_main


TOLERANCE = {"float32": (1e-5, 1e-5), "float64": (1e-12, 1e-12)}  # (rtol, atol); int64 is exact
BYTES_SLACK = 0.10  # a ring may pad its chunks or send a few extra bytes; "send everything" is 50 %+ more
SEND_OPS = ("send", "isend")
RECV_OPS = ("recv", "irecv")
# What gloo adds on the wire, measured with grader.traffic: 96 bytes of headers with each message sent, 48 bytes
# back from each receive (its notification), 8 bytes when a connection opens; a FIN counts one.
GLOO_BYTES_PER_MESSAGE = 96 + 48
CONTROL_SHARE = 0.25  # a link outside the ring carries at most control messages: less than 1/4 of one chunk


def grade(g: Grader) -> None:
    drawn = drawn_cases()
    sizes = list(g.world_sizes)
    if 1 not in sizes:
        sizes.append(1)  # world size 1 must leave the tensor alone
    measured = False
    counted = []
    for world_size in sizes:
        cases = cases_for(world_size, drawn)
        outcome = g.run(ring_main, world_size, kwargs={"cases": cases}, traffic=world_size >= 2)
        if world_size >= 2:
            timelines.keep(g, outcome, f"world size {world_size}")
        observations = outcome.results()
        check_results(g, cases, observations, world_size)
        if not completed_a_case(observations):  # nothing ran to judge how it communicates
            for check in ("no-collectives", "ring-neighbours", "ring-bytes")[:1 + min(world_size - 1, 2)]:
                g.not_checked(check, "matches-all-reduce", f"ring_all_reduce completed no case at world size "
                              f"{world_size}", world_size=world_size)
            measured = measured or world_size >= 3
            continue
        check_no_collectives(g, observations, world_size)
        if world_size >= 2:
            check_neighbours(g, observations, world_size, outcome.traffic)
            if outcome.traffic is not None:
                counted.append(f"world size {world_size} ({describe_ring(cases, world_size)}):\n"
                               + outcome.traffic.table())
        if world_size >= 3:
            check_bytes(g, cases, observations, world_size, outcome.traffic)
            measured = True
    if counted:
        g.section("the bytes each rank sent, as the kernel counted them", "\n".join(counted))
    if max(sizes) < 2:
        g.skip("ring-neighbours", "a ring needs at least 2 ranks (use --world-size 3 or more)")
    if not measured:
        g.skip("ring-bytes", "the traffic of a ring differs from a naive exchange only at world size 3 or more")


def expected_sum(case: dict, world_size: int) -> torch.Tensor:
    parts = [make_tensor(case, rank) for rank in range(world_size)]
    if case["dtype"] == "int64":
        return torch.stack(parts).sum(0)
    return torch.stack(parts).to(torch.float64).sum(0)


def describe_case(case: dict) -> str:
    return f"shape {tuple(case['shape'])} {case['dtype']}"


def check_results(g, cases: list[dict], observations: list[dict], world_size: int) -> None:
    ran = min(len(obs["cases"]) for obs in observations)
    for index, case in enumerate(cases[:ran]):
        expected = expected_sum(case, world_size)
        for rank, obs in enumerate(observations):
            got = obs["cases"][index]
            if "error" in got:
                continue
            problem = compare(got["result"], expected, case)
            if problem is None:
                continue
            what = "the sum over ranks" if world_size > 1 else "the tensor as it was (world size 1)"
            message = f"world size {world_size}, {describe_case(case)}: rank {rank}'s tensor after ring_all_reduce is not {what}: {problem}"
            if got["returned"] == "Tensor":
                message += "; ring_all_reduce returned a tensor, but it must sum in place and return None"
            g.record("matches-all-reduce", False, message, rank=rank, world_size=world_size)
            return
    crash = first_crash(cases, observations)
    if crash is not None:
        rank, index, err = crash
        where = f" (line {err['where']['line']}, in {err['where']['function']})" if err.get("where") else ""
        g.record("matches-all-reduce", False,
                 f"world size {world_size}, {describe_case(cases[index])}: rank {rank}'s ring_all_reduce raised "
                 f"{err['type']}: {err['message'][:300]}{where}; the other checks were decided on the "
                 f"{index} case(s) before it", rank=rank, world_size=world_size)
        return
    g.record("matches-all-reduce", True)


def completed_a_case(observations: list[dict]) -> bool:
    """Whether every rank completed at least one case (the calls a check of the ring's traffic judges)."""
    return all(any("error" not in case for case in obs["cases"]) for obs in observations)


def first_crash(cases: list[dict], observations: list[dict]) -> tuple[int, int, dict] | None:
    """(rank, case index, error) of the exception that came first, or None when every case ran.

    A rank whose peer raised mid-ring fails too ("Connection closed by peer"): the earliest
    error is the cause.
    """
    crashes = [(obs["cases"][-1]["error"].get("at", 0.0), rank, len(obs["cases"]) - 1, obs["cases"][-1]["error"])
               for rank, obs in enumerate(observations) if obs["cases"] and "error" in obs["cases"][-1]]
    if not crashes:
        return None
    _, rank, index, err = min(crashes, key=lambda c: (c[2], c[0]))
    return rank, index, err


def compare(got: torch.Tensor, expected: torch.Tensor, case: dict) -> str | None:
    dtype = DTYPES[case["dtype"]]
    if tuple(got.shape) != tuple(expected.shape) or got.dtype != dtype:
        return f"it became shape {tuple(got.shape)} {str(got.dtype).replace('torch.', '')}"
    if case["dtype"] == "int64":
        wrong = got != expected
    else:
        rtol, atol = TOLERANCE[case["dtype"]]
        wrong = (got.to(torch.float64) - expected).abs() > atol + rtol * expected.abs()
        wrong |= torch.isnan(got)
    if not bool(wrong.any()):
        return None
    flat_index = int(wrong.reshape(-1).nonzero()[0])
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), tuple(expected.shape))) \
        if expected.dim() else ()
    g_val, e_val = got.reshape(-1)[flat_index].item(), expected.reshape(-1)[flat_index].item()
    count = int(wrong.sum())
    return (f"{count} of {expected.numel()} element(s) differ, the first at index {where}: "
            f"{_number(g_val)} instead of {_number(e_val)}")


def _number(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:.9g}"


def check_no_collectives(g, observations: list[dict], world_size: int) -> None:
    for rank, obs in enumerate(observations):
        used = sorted({e["op"] for case in obs["cases"] for e in case["events"]
                       if e["op"] in probes.COLLECTIVES})
        if used:
            g.record("no-collectives", False,
                     f"rank {rank} called {', '.join('dist.' + op for op in used)}; only dist.send, dist.recv, "
                     "dist.isend and dist.irecv are allowed", rank=rank, world_size=world_size)
            return
    g.record("no-collectives", True)


def describe_ring(cases: list[dict], world_size: int) -> str:
    """"a ring sends 2 (W - 1) / W of its cases' 245,000 bytes: 367,500 to its next rank"."""
    total = sum(case_bytes(case) for case in cases)
    return (f"a ring sends 2 (W - 1) / W of its cases' {total:,} bytes: about "
            f"{int(ring_bytes(cases, world_size)):,} to its next rank")


def case_bytes(case: dict) -> int:
    numel = 1
    for n in case["shape"]:
        numel *= n
    return numel * torch.empty(0, dtype=DTYPES[case["dtype"]]).element_size()


def ring_bytes(cases: list[dict], world_size: int) -> float:
    """What a ring all-reduce of every case sends from each rank: 2 (W - 1) / W of each tensor."""
    return 2 * (world_size - 1) / world_size * sum(case_bytes(case) for case in cases)


def control_limit(world_size: int) -> float:
    """The most a link outside the ring may carry: control messages, well below one chunk of the measured
    tensor."""
    return CONTROL_SHARE * BIG_NUMEL * 4 / world_size


def check_neighbours(g, observations: list[dict], world_size: int, counted=None) -> None:
    """ring-neighbours: a call to a rank outside the ring fails it, by name; the verdict that counts is what the
    kernel counted (``counted``, a grader.traffic.RunTraffic): no link outside the ring carries more than
    control messages. Where the kernel's counters cannot be read, the calls alone decide (a claim)."""
    if not _neighbour_calls(g, observations, world_size):
        return
    if counted is None:
        g.record("ring-neighbours", True, evidence=CLAIM)
        return
    problem = traffic_problem(counted)
    if problem is None:
        for i in range(world_size):
            for j in range(world_size):
                if j != i and j not in ((i + 1) % world_size, (i - 1) % world_size) and \
                        counted.to(i, j) > control_limit(world_size):
                    problem = (f"rank {i} sent rank {j} {counted.to(i, j):,} bytes (the kernel's count); in a ring it "
                               f"talks only to ranks {sorted({(i + 1) % world_size, (i - 1) % world_size})}, and a "
                               f"link outside the ring carries at most control messages "
                               f"({int(control_limit(world_size)):,} bytes)", i)
                    break
            if problem is not None:
                break
    if problem is not None:
        g.record("ring-neighbours", False, f"world size {world_size}: {problem[0]}", rank=problem[1],
                 world_size=world_size)
        return
    g.record("ring-neighbours", True)


def traffic_problem(counted) -> tuple[str, int] | None:
    """Why the kernel's count of a run cannot stand for its ranks (a rank whose sockets were never read), or
    None."""
    if counted.uncounted():
        rank = counted.uncounted()[0]
        return (f"rank {rank}'s connections were never counted: its process did not let the grader read its "
                "sockets (it asks as its process group is made and destroyed, and as the run ends)", rank)
    return None


def _neighbour_calls(g, observations: list[dict], world_size: int) -> bool:
    """ring-neighbours from the calls each rank recorded: False (and recorded as failed) when one names a rank
    outside the ring."""
    for rank, obs in enumerate(observations):
        neighbours = {(rank + 1) % world_size, (rank - 1) % world_size}
        for case in obs["cases"]:
            for e in case["events"]:
                if e["op"] not in SEND_OPS + RECV_OPS:
                    continue
                if e["op"] in RECV_OPS and e["peer"] is None:
                    continue  # a receive from any source: the matching send is checked at its sender
                if e["peer"] not in neighbours:
                    direction = "sent to" if e["op"] in SEND_OPS else "received from"
                    g.record("ring-neighbours", False,
                             f"rank {rank} {direction} rank {e['peer']} (dist.{e['op']}); in a ring it talks "
                             f"only to ranks {sorted(neighbours)}", rank=rank, world_size=world_size, evidence=CLAIM)
                    return False
    return True


def check_bytes(g, cases: list[dict], observations: list[dict], world_size: int, counted=None) -> None:
    """ring-bytes: the calls each rank recorded for the measured tensor name a wrong count; the verdict that
    counts is the kernel's: the bytes each rank sent the others over the whole run are what a ring sends of
    every case, 2 (W - 1) / W of each tensor, within BYTES_SLACK and gloo's headers. Where the kernel's counters
    cannot be read, the calls alone decide (a claim)."""
    index = next(i for i, c in enumerate(cases) if c["measure"])
    ran = min(sum(1 for c in obs["cases"] if "error" not in c) for obs in observations)  # every case before one raised
    if ran <= index:
        return  # the measured case did not run: ring-bytes stays undecided
    nbytes = BIG_NUMEL * 4
    expected = 2 * (world_size - 1) / world_size * nbytes
    for rank, obs in enumerate(observations):
        sent = sum(e["bytes"] for e in obs["cases"][index]["events"] if e["op"] in SEND_OPS)
        if abs(sent - expected) > BYTES_SLACK * expected:
            g.record("ring-bytes", False,
                     f"for a {nbytes}-byte tensor rank {rank} sent {sent} bytes ({sent / nbytes:.2f} x the tensor); "
                     f"a ring sends 2 * (W - 1) / W of it, {int(expected)} bytes ({expected / nbytes:.2f} x)",
                     rank=rank, world_size=world_size, evidence=CLAIM)
            return
    if counted is None:
        g.record("ring-bytes", True, evidence=CLAIM)
        return
    # The cases every rank finished; a case that raised part way may have sent up to a ring's worth of its own.
    want = ring_bytes(cases[:ran], world_size)
    allowance = BYTES_SLACK * want + GLOO_BYTES_PER_MESSAGE * 2 * (world_size - 1) * len(cases[:ran + 1]) \
        + ring_bytes(cases[ran:ran + 1], world_size)
    problem = traffic_problem(counted)
    if problem is not None:
        g.record("ring-bytes", False, f"world size {world_size}: {problem[0]}", rank=problem[1], world_size=world_size)
        return
    for rank in range(world_size):
        sent = counted.out_of(rank)
        if abs(sent - want) > allowance:
            g.record("ring-bytes", False,
                     f"world size {world_size}: over its {ran} tensors ({sum(map(case_bytes, cases[:ran])):,} bytes "
                     f"each rank), rank {rank} sent the other ranks {sent:,} bytes (the kernel's count, "
                     f"{sent / max(1, want):.2f} x a ring's); a ring sends 2 * (W - 1) / W of each tensor, "
                     f"{int(want):,} bytes, and gloo adds at most {GLOO_BYTES_PER_MESSAGE} bytes a message",
                     rank=rank, world_size=world_size)
            return
    g.record("ring-bytes", True)
