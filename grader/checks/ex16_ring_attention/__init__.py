"""Exercise 16: ring_attention (context parallelism: K/V blocks around a ring, online softmax).

Rank side: every rank builds the same seeded q, k, v and output gradient G for the whole
sequence (float64), keeps its own chunk, calls the learner's ring_attention on it and runs
backward of sum(output * G). It records the output and the gradients of q, k and v, every
torch.distributed call of forward and of backward (bytes and peer), the multiply-adds of every
matrix product (counted below autograd by a TorchDispatchMode, so einsum, @ and
scaled_dot_product_attention all count), and, before each of those products and right after
forward, which other ranks' key/value blocks are in memory: their bytes are looked for in the
storages the learner's running frames, its module, its autograd graph and what autograd saved
for backward hold. Scenarios, in this order: non-causal, causal, queries scaled by 1000, the
optional zigzag layout, and (in the largest world) two groups, each running its own ring (group=). A second
run per pattern gives the ranks chunks of different lengths (tensor_split of a sequence the world size
does not divide; and lengths whose sum is W times the mean, which a check of the total misses), where a
refusal on every rank is expected. Grader side: single-process attention on
the whole sequence, in this process, and every rank's tensors compared with its chunk of it.
"""

from __future__ import annotations

from grader.rank.drivers.ex16_ring_attention import (BATCH, CHUNK, HEADS, HEAD_DIM, MOST_HELD, UNEVEN_PATTERNS,
                                                    block_macs, rank_main, uneven_main)
from grader.checks.ex16_ring_attention.reference import expected_for
from grader.checks.ex16_ring_attention.verdicts import (big_messages, check_causal_work, check_gradients, check_group,
                                                        check_held, check_hops, check_neighbours, check_outputs,
                                                        check_stable, check_uneven, check_zigzag)
from grader.checks.interface import Grader
from grader.checks.shared import timelines


def grade(g: Grader) -> None:
    largest = max(g.world_sizes)
    # The groups (two interleaved rings) run in the largest world only: new groups cost time to connect.
    runs = [g.Run(rank_main, world_size, {"groups": world_size == largest}) for world_size in g.world_sizes]
    if largest >= 2:  # chunks of different lengths, each pattern in a run of its own: gloo may abort a rank there
        runs += [g.Run(uneven_main, largest, {"pattern": pattern}, expect_ok=False) for pattern in UNEVEN_PATTERNS]
    started = timelines.clock()
    outcomes = g.run_at_once(runs)  # light runs: a re-grade waits for the slowest, not for their sum
    held_decided = False
    zigzag_seen = set()
    lines = []
    for world_size in g.world_sizes:
        outcome = next(outcomes)
        timelines.keep(g, outcome, f"world size {world_size}", shown=world_size == largest, draw=("plain",),
                       started=started)
        observations = outcome.results()
        expected = expected_for(world_size)
        check_outputs(g, observations, expected, world_size)
        check_gradients(g, observations, expected, world_size)
        check_stable(g, observations, expected["large"], world_size)
        check_neighbours(g, observations, world_size)
        check_hops(g, observations, world_size)
        check_causal_work(g, observations, world_size)
        if world_size > MOST_HELD + 1:
            check_held(g, observations, world_size)
            held_decided = True
        if world_size == largest:
            check_group(g, observations, expected["group"], world_size)
        zigzag_seen.add(check_zigzag(g, observations, expected["zigzag"], world_size))
        lines.append(describe_ring(observations, world_size))
    if not held_decided:
        g.skip("two-blocks-held", f"with {largest} ranks there are at most {largest - 1} other ranks' blocks: the "
               f"limit of {MOST_HELD} shows from {MOST_HELD + 2} ranks on")
    if zigzag_seen == {"absent"}:
        for check_id in ("zigzag-matches", "zigzag-balanced"):
            g.skip(check_id, "optional: zigzag_ring_attention is not defined, or raises NotImplementedError")
    if largest >= 2:
        for pattern in UNEVEN_PATTERNS:
            check_uneven(g, next(outcomes), largest, pattern)
    else:
        g.skip("uneven-refused", "one rank: every sequence is divisible by 1")
    g.section("the ring, as measured", "\n".join(lines))


# --- the report's section -----------------------------------------------------------------------


def describe_ring(observations: list[dict], world_size: int) -> str:
    """One line per world size: what each rank sent in forward, its block products, the most blocks held."""
    unit = block_macs()
    block = BATCH * HEADS * CHUNK * HEAD_DIM * 8

    def per_rank(values) -> str:
        return "/".join(f"{v:g}" for v in values)

    sent = [sum(e["bytes"] for e in big_messages(obs["plain"]["forward_events"], ("send", "isend"))) / block
            for obs in observations]
    forward = [obs["causal"]["forward_macs"] / unit for obs in observations]
    backward = [obs["causal"]["backward_macs"] / unit for obs in observations]
    line = (f"{world_size} ranks (rank 0/1/...): blocks sent per forward {per_rank(sent)}; causal block products "
            f"forward {per_rank(forward)}, backward {per_rank(backward)}")
    if world_size > MOST_HELD + 1:
        held = [len((obs["plain"].get("held") or {}).get("most", [])) for obs in observations]
        line += f"; most other ranks' K/V held at once {per_rank(held)}"
    return line
