"""Exercise 20: ulysses_attention (context parallelism by all-to-all, DeepSpeed-Ulysses).

Rank side (:mod:`.rank`): every rank builds the same seeded q, k, v and output gradient G for the whole
sequence (float64), keeps its own chunk, calls the learner's ulysses_attention on it and runs backward of
sum(output * G). It records the output and the gradients, every collective its forward and its backward
dispatched (recorded below autograd, so the backwards autograd runs from C++ count too; for each all-to-all
the bytes this rank kept and sent off), and the most heads of q, k and v whose whole sequence it held at
once: each position's row is looked for byte for byte in the storages the learner's running frames, its
module, its autograd graph, what autograd saved and the operation at hand reach, after each collective and
before each matrix product. Scenarios: multi-head attention (non-causal, causal), grouped-query attention
with two key/value heads per rank and with fewer than W, and in the largest world two groups, each on its own
sequence (group=). Two more runs give heads W does not split (query heads, with one key/value head, which W
splits; key/value heads neither dividing W nor divisible by it), where every rank must raise ValueError.

Grader side (:mod:`.reference`, :mod:`.verdicts`): single-process attention on the whole sequence, every
rank's tensors compared with its chunk of it; the messages, bytes and memory against the method's.
"""

from __future__ import annotations

from grader.checks.ex20_ulysses import verdicts
from grader.rank.drivers.ex20_ulysses import rank_main, refusal_main
from grader.checks.interface import Grader
from grader.checks.shared import timelines

REFUSAL_PATTERNS = ("heads", "kv-heads")


def grade(g: Grader) -> None:
    largest = max(g.world_sizes)
    # The groups run in the largest world only: new groups cost time to connect.
    runs = [g.Run(rank_main, world_size, {"groups": world_size == largest}) for world_size in g.world_sizes]
    if largest >= 2:  # each pattern in a run of its own: a rank that does not refuse may be aborted by gloo
        runs += [g.Run(refusal_main, largest, {"pattern": pattern}, expect_ok=False)
                 for pattern in REFUSAL_PATTERNS]
    started = timelines.clock()
    outcomes = g.run_at_once(runs)  # light runs: a re-grade waits for the slowest, not for their sum
    lines = []
    for world_size in g.world_sizes:
        outcome = next(outcomes)
        timelines.keep(g, outcome, f"world size {world_size}", started=started)
        observations = outcome.results()
        verdicts.check_outputs(g, observations, world_size)
        verdicts.check_gradients(g, observations, world_size)
        verdicts.check_gqa(g, observations, world_size)
        verdicts.check_messages(g, observations, world_size)
        verdicts.check_held(g, observations, world_size)
        if world_size == largest:
            verdicts.check_group(g, observations, world_size)
        lines.append(verdicts.describe(observations, world_size))
    if largest >= 2:
        for pattern in REFUSAL_PATTERNS:
            verdicts.check_refused(g, next(outcomes), largest, pattern)
    else:
        g.skip("heads-refused", "one rank: every number of heads is divisible by 1")
    g.section("the all-to-alls, as measured", "\n".join(lines))
