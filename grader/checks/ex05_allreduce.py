"""Exercise 05: SimpleDDP, gradient averaging written by hand.

Rank side: one run per world size, in order: construct the wrapper on identical
weights; use its API; train a few steps, recording each rank's gradients after
backward and after sync_gradients (and every collective call); probe no_sync;
a model with a frozen layer; last, construct on weights that differ on the last
rank, under a short collective timeout so that a rank left waiting shows up as
an error. Grader side: recompute every rank's local gradient from the parameters
and data the ranks used, train what torch's DistributedDataParallel would reach
on the same data (no rank holds it), and decide each check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grader.compare import first_difference, tensor_difference
from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.checks.shared.data_parallel import train_on_mean_gradients
from grader.rank.drivers.ex05_allreduce import (FROZEN_STEP, LR, PERTURBATION, PERTURBED, STEPS, batch, build_model,
                                                rank_main)


RTOL, ATOL = 1e-5, 1e-6


def grade(g: Grader) -> None:
    for world_size in g.world_sizes:
        outcome = g.run(rank_main, world_size)
        timelines.keep(g, outcome, f"world size {world_size}")
        check_world(g, outcome.results(), world_size)
    if max(g.world_sizes) < 2:
        g.skip("init-rejects-mismatch", "needs at least 2 ranks: one alone always has rank 0's weights")


def check_world(g, observations: list[dict], world_size: int) -> None:
    """Every check of one run, from the ranks' observations."""

    def record(check_id, ok, message="", rank=None):
        return g.record(check_id, ok, message, rank=rank, world_size=world_size)

    check_construction(g, record, observations)
    check_api(record, observations)
    check_steps(record, observations, world_size)
    check_final_params(record, observations)
    check_no_sync(record, observations)
    check_frozen(record, observations, world_size)
    check_mismatch(record, observations, world_size)


def check_construction(g, record, observations: list[dict]) -> None:
    """Construction on identical weights: no error, no torch DDP inside; stop if it raised."""
    for rank, obs in enumerate(observations):
        err = obs["init_error"]
        record("init-accepts-identical", err is None,
               f"rank {rank}: SimpleDDP(model) raised {_describe(err)} although every rank has the same weights",
               rank)
    for rank, obs in enumerate(observations):
        record("no-torch-ddp", obs["ddp_built"] == 0,
               f"rank {rank}: torch's DistributedDataParallel was constructed {obs['ddp_built']} time(s) "
               "inside SimpleDDP; average the gradients yourself", rank)
    failed = next((r for r, o in enumerate(observations) if o["init_error"]), None)
    if failed is not None:
        g.stop(f"SimpleDDP(model) raised {_describe(observations[failed]['init_error'])} on rank "
               f"{failed} with identical weights on every rank; nothing after construction could be checked")
    _check_init_ops(record, observations, "init_ops", "with identical weights")


def check_api(record, observations: list[dict]) -> None:
    """.module, calling the wrapper, train() and eval()."""
    for rank, obs in enumerate(observations):
        problems = []
        if not obs["module_is_model"]:
            problems.append(".module is not the model given to SimpleDDP")
        if not (isinstance(obs["output"], torch.Tensor) and torch.equal(obs["output"], obs["model_output"])):
            problems.append("calling the wrapper did not return the model's output")
        still = sum(obs["training_after_eval"])
        if still:
            problems.append(f"after wrapper.eval(), {still} of the model's {len(obs['training_after_eval'])} "
                            "modules are still in training mode")
        off = len(obs["training_after_train"]) - sum(obs["training_after_train"])
        if off:
            problems.append(f"after wrapper.train(), {off} of the model's {len(obs['training_after_train'])} "
                            "modules are not in training mode")
        record("wraps-module", not problems, f"rank {rank}: " + "; ".join(problems), rank)


def check_steps(record, observations: list[dict], world_size: int) -> None:
    """Each training step's gradients, against the local and mean gradients computed here."""
    for step in range(STEPS):
        records = [obs["steps"][step] for obs in observations]
        expected = [local_gradients(rec["params"], rank, step) for rank, rec in enumerate(records)]
        mean = {name: sum(e[name] for e in expected) / world_size for name in expected[0]}
        for rank, rec in enumerate(records):
            record("grads-local-until-sync", *_local_verdict(rec, expected[rank], mean, rank, step), rank)
            record("grads-averaged", *_averaged_verdict(rec["synced"], mean, world_size, rank,
                                                        f"step {step}, rank {rank}"), rank)


def ddp_parameters(world_size: int) -> dict[str, torch.Tensor]:
    """What torch's DistributedDataParallel reaches after STEPS steps of SGD(lr=LR) on the ranks' batches, trained
    here on the mean of the ranks' gradients."""
    model = build_model()
    return train_on_mean_gradients(model, torch.optim.SGD(model.parameters(), lr=LR), STEPS, world_size, _loss)


def _loss(model, step: int, rank: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return F.cross_entropy(model(x), y)


def check_final_params(record, observations: list[dict]) -> None:
    """After the steps: the same parameters on every rank, and torch DDP's (trained here)."""
    final0 = observations[0]["final"]
    for rank, obs in enumerate(observations[1:], start=1):
        name, diff = _first_difference(obs["final"], final0, exact=True)
        record("params-identical", name is None,
               f"after {STEPS} steps, rank {rank}'s {name} differs from rank 0's by up to {diff:.3g}", rank)
    record("params-identical", True)
    expected = ddp_parameters(len(observations))
    for rank, obs in enumerate(observations):
        name, diff = _first_difference(obs["final"], expected)
        record("matches-torch-ddp", name is None,
               f"after {STEPS} steps of SGD(lr={LR}) on the same data, rank {rank}'s {name} differs from "
               f"torch DistributedDataParallel's by up to {diff:.3g}", rank)


def check_no_sync(record, observations: list[dict]) -> None:
    """no_sync(): silent inside, syncing again after it, after an exception and after nesting."""
    for rank, obs in enumerate(observations):
        ns = obs["no_sync"]
        if "error" in ns:
            err = ns["error"]
            at = f" (line {err['where']['line']}, in {err['where']['function']})" if err.get("where") else ""
            message = f"rank {rank}: using no_sync() raised {err['type']}: {err['message'][:200]}{at}"
            record("no-sync-silent", False, message, rank)
            record("no-sync-restores", False, message, rank)
            continue
        ops = ns["inside_ops"]
        changed, _ = _first_difference(ns["after_sync"], ns["before_sync"], exact=True)
        record("no-sync-silent", not ops and changed is None,
               f"rank {rank}: {len(ops)} collective call(s) inside no_sync() ({_summary(ops)})" if ops else
               f"rank {rank}: sync_gradients() inside no_sync() changed {changed}'s .grad", rank)
        if not obs["steps"][0]["sync_ops"]:
            record("no-sync-restores", False, f"rank {rank}: sync_gradients() made no collective call even "
                   "outside no_sync(), so no_sync() cannot be seen turning syncing off and back on", rank)
            continue
        problems = []
        if not ns["after_exit_ops"]:
            problems.append("after leaving no_sync(), sync_gradients() made no collective call")
        if not ns["exception_propagated"]:
            problems.append("an exception raised inside no_sync() did not come out of the with block")
        if not ns["after_exception_ops"]:
            problems.append("after an exception inside no_sync(), sync_gradients() stayed off")
        if ns["nested_ops"]:
            problems.append("after an inner no_sync() inside another one, syncing was already on again "
                            f"({_summary(ns['nested_ops'])}): restore the previous state, not True")
        if not ns["after_nested_ops"]:
            problems.append("after nested no_sync() blocks, sync_gradients() stayed off")
        record("no-sync-restores", not problems, f"rank {rank}: " + "; ".join(problems), rank)


def check_frozen(record, observations: list[dict], world_size: int) -> None:
    """A frozen layer keeps .grad None; the others are still averaged."""
    expected = [local_gradients(build_model().state_dict(), rank, FROZEN_STEP) for rank in range(world_size)]
    mean = {name: sum(e[name] for e in expected) / world_size for name in expected[0]}
    for rank, obs in enumerate(observations):
        if obs["frozen_error"]:
            record("frozen-params", False, f"rank {rank}: with the hidden layer frozen (its .grad is None), "
                   f"sync_gradients() raised {_describe(obs['frozen_error'])}", rank)
            continue
        grads = obs["frozen_grads"]
        given = [n for n in ("hidden.weight", "hidden.bias") if grads[n] is not None]
        if given:
            record("frozen-params", False, f"rank {rank}: frozen {given[0]} had .grad None, and sync_gradients() "
                   "gave it a gradient", rank)
            continue
        head = {n: grads[n] for n in ("head.weight", "head.bias")}
        record("frozen-params", *_averaged_verdict(head, mean, world_size, rank,
                                                   f"with a frozen layer, rank {rank}"), rank)


def check_mismatch(record, observations: list[dict], world_size: int) -> None:
    """Weights that differ on the last rank: a ValueError naming the first one, and no rank left waiting."""
    last = world_size - 1
    if world_size < 2:
        _check_init_ops(record, observations, "mismatch_ops", "on one rank")
        return
    err = observations[last]["mismatch_error"]
    first, other = PERTURBED
    if err is None:
        record("init-rejects-mismatch", False,
               f"rank {last}'s {first} and {other} differ from rank 0's by {PERTURBATION:g}, "
               f"but SimpleDDP(model) on rank {last} returned without raising", last)
    elif err["type"] != "ValueError":
        record("init-rejects-mismatch", False, f"rank {last}, whose {first} differs from rank 0's, raised "
               f"{_describe(err)}; expected a ValueError", last)
    elif first not in err["message"]:
        named = f" (it names {other}, which comes later)" if other in err["message"] else ""
        record("init-rejects-mismatch", False, f"rank {last} raised ValueError: {err['message']!r}, which does not "
               f"name {first}, the first parameter that differs{named}", last)
    else:
        record("init-rejects-mismatch", True)
    _check_init_ops(record, observations, "mismatch_ops", f"when rank {last}'s weights differ")
    for rank, obs in enumerate(observations[:last]):
        err = obs["mismatch_error"]
        if err is not None and err["type"] != "ValueError":
            record("init-no-rank-waits", False,
                   f"rank {rank}, whose weights are rank 0's, was left waiting while rank {last} raised: its "
                   f"SimpleDDP(model) failed with {_describe(err)}", rank)


def _check_init_ops(record, observations: list[dict], key: str, when: str) -> None:
    counts = [len(o[key]) for o in observations]
    if len(set(counts)) > 1:
        fewest = counts.index(min(counts))
        most = counts.index(max(counts))
        record("init-no-rank-waits", False,
               f"{when}, rank {fewest} made {counts[fewest]} collective call(s) in SimpleDDP.__init__ and rank "
               f"{most} made {counts[most]}: a rank that stops early (e.g. raises at the first difference) "
               "leaves the others waiting", fewest)
    else:
        record("init-no-rank-waits", True)


def _local_verdict(rec: dict, expected: dict, mean: dict, rank: int, step: int) -> tuple[bool, str]:
    where = f"step {step}, rank {rank}"
    if rec["backward_ops"]:
        return False, (f"{where}: {len(rec['backward_ops'])} collective call(s) during backward "
                       f"({_summary(rec['backward_ops'])}); gradients must stay local until sync_gradients()")
    for name, want in expected.items():
        got = rec["local"][name]
        if got is None:
            return False, f"{where}: {name}.grad is None after backward"
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            averaged = " (it is already the mean over ranks)" if torch.allclose(got, mean[name], rtol=RTOL,
                                                                                 atol=ATOL) else ""
            return False, (f"{where}: after backward, {name}.grad differs from this rank's own gradient by up to "
                           f"{_max_diff(got, want):.3g}{averaged}")
    return True, ""


def _averaged_verdict(grads: dict, mean: dict, world_size: int, rank: int, where: str) -> tuple[bool, str]:
    for name, got in grads.items():
        want = mean[name]
        if got is None:
            return False, f"{where}: {name}.grad is None after sync_gradients()"
        if torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            continue
        why = ""
        if torch.allclose(got, want * world_size, rtol=RTOL, atol=ATOL):
            why = f" (it is the sum, {world_size}x the mean: divide by the world size)"
        return False, (f"{where}: after sync_gradients(), {name}.grad differs from the mean of the ranks' "
                       f"gradients by up to {_max_diff(got, want):.3g}{why}")
    return True, ""


def local_gradients(params: dict, rank: int, step: int) -> dict:
    """The gradient rank ``rank`` gets alone at ``params`` on its batch of ``step``."""
    model = build_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    x, y = batch(rank, step)
    F.cross_entropy(model(x), y).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _first_difference(got: dict, want: dict, exact: bool = False) -> tuple[str | None, float]:
    found = first_difference(got, want, rtol=0.0 if exact else RTOL, atol=0.0 if exact else ATOL, extra_ok=True)
    return (found.name, found.max_abs) if found is not None else (None, 0.0)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    found = tensor_difference(a, b)
    return found.max_abs if found is not None else 0.0


def _summary(ops: list[str]) -> str:
    counts: dict = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(f"{op} x{n}" for op, n in counts.items())


def _describe(err: dict | None) -> str:
    if err is None:
        return "nothing"
    message = " ".join(err["message"].split())
    return f"{err['type']}: {message[:200]}" + ("..." if len(message) > 200 else "")
