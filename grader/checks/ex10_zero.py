"""Exercise 10: ShardedOptimizer (ZeRO stage 1).

One run per world size. Each rank trains a model wrapped in torch's DDP with
the learner's ShardedOptimizer over AdamW, and returns its parameters, which
parameters its ``.local_optimizer`` holds, the bytes of every optimizer-state
tensor reachable from the ShardedOptimizer, and what ``zero_grad`` left in
``.grad``. Then twice more: with a learning-rate scheduler, and on a model with
a single parameter, so that every rank but one owns nothing. The grader trains
the unsharded AdamW the parameters must equal itself, outside the ranks, on the
same model and batches (each step's gradient the mean of the ranks' own, as
DDP's), and computes its state bytes; no rank holds an answer.
"""

from __future__ import annotations

import torch

from grader.checks.interface import Grader
from grader.checks.shared import timelines
from grader.checks.shared.data_parallel import train_on_mean_gradients
from grader.compare import first_difference
from grader.rank.drivers.ex10_zero import (OPTIMIZER_KWARGS, STEPS, batch, build_model, build_single_parameter_model,
                                           lr_factor, rank_main, state_bytes)


ATOL, RTOL = 1e-6, 1e-5


def unsharded_state_bytes() -> int:
    """What plain AdamW over the whole model keeps, measured the same way as in the ranks."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER_KWARGS)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return state_bytes([optimizer], {p.untyped_storage().data_ptr() for p in model.parameters()})


def unsharded_parameters(build, world_size: int, scheduled: bool = False) -> dict[str, torch.Tensor]:
    """The parameters plain AdamW over the whole model reaches after STEPS steps of the ranks' batches, trained
    here on the mean of the ranks' gradients (as DDP's); with ``scheduled`` the learning rate follows
    ``lr_factor`` (LambdaLR)."""
    from torch.optim.lr_scheduler import LambdaLR

    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), **OPTIMIZER_KWARGS)
    return train_on_mean_gradients(model, optimizer, STEPS, world_size, _loss,
                                   LambdaLR(optimizer, lr_factor) if scheduled else None)


def _loss(model, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    return torch.nn.functional.mse_loss(model(x), y)


def grade(g: Grader) -> None:
    model = build_model()
    names = [name for name, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    full_state = unsharded_state_bytes()
    per_parameter_state = [full_state * s / sum(sizes) for s in sizes]
    for world_size in g.world_sizes:
        outcome = g.run(rank_main, world_size)
        timelines.keep(g, outcome, f"world size {world_size}")
        observations = outcome.results()
        check_local_optimizer(g, observations, names, world_size)
        check_balance(g, observations, sizes, world_size)
        check_state(g, observations, full_state, max(per_parameter_state), world_size)
        check_parameters(g, observations, unsharded_parameters(build_model, world_size), world_size)
        check_zero_grad(g, observations, names, world_size)
        check_scheduled(g, observations, unsharded_parameters(build_model, world_size, scheduled=True), world_size)
        check_owns_nothing(g, observations, unsharded_parameters(build_single_parameter_model, world_size),
                           world_size)


def check_local_optimizer(g, observations: list[dict], names: list[str], world_size: int) -> None:
    owners: dict[int, list[int]] = {}
    for rank, obs in enumerate(observations):
        if not obs["is_optimizer"]:
            g.record("local-optimizer", False, f"rank {rank}: ShardedOptimizer is not a torch.optim.Optimizer "
                     "subclass instance", rank=rank, world_size=world_size)
        if obs["local_params"] is None:
            g.record("local-optimizer", False, f"rank {rank}: the ShardedOptimizer has no .local_optimizer",
                     rank=rank, world_size=world_size)
            return
        if not obs["local_is_adamw"]:
            g.record("local-optimizer", False, f"rank {rank}: .local_optimizer is a {obs['local_type']}, not the "
                     "optimizer_cls given (torch.optim.AdamW)", rank=rank, world_size=world_size)
        for index in obs["local_params"]:
            if index < 0:
                g.record("local-optimizer", False, f"rank {rank}: .local_optimizer holds a tensor that is not one "
                         "of the parameters given", rank=rank, world_size=world_size)
                return
            owners.setdefault(index, []).append(rank)
    shared = {i: r for i, r in owners.items() if len(r) > 1}
    if shared:
        i, ranks = next(iter(sorted(shared.items())))
        g.record("local-optimizer", False, f"{len(shared)} of {len(names)} parameters are in the .local_optimizer "
                 f"of more than one rank (e.g. {names[i]!r} on ranks {ranks}): each parameter needs one owner",
                 world_size=world_size)
        return
    missing = [names[i] for i in range(len(names)) if i not in owners]
    g.record("local-optimizer", not missing, f"{len(missing)} of {len(names)} parameters are in no rank's "
             f".local_optimizer (e.g. {missing[:1]}): nobody updates them", world_size=world_size)


def _owned(observations: list[dict]) -> list[list[int]] | None:
    if any(o["local_params"] is None for o in observations):
        return None
    return [[i for i in o["local_params"] if i >= 0] for o in observations]


def check_balance(g, observations: list[dict], sizes: list[int], world_size: int) -> None:
    owned = _owned(observations)
    if owned is None:
        g.record("balanced-by-size", False, "without .local_optimizer the assignment cannot be seen",
                 world_size=world_size)
        return
    total, largest = sum(sizes), max(sizes)
    limit = total / world_size + largest  # what any greedy "to the least loaded rank" stays within
    loads = [sum(sizes[i] for i in set(indices)) for indices in owned]
    for rank, load in enumerate(loads):
        g.record("balanced-by-size", load <= limit,
                 f"rank {rank} owns {load} of the model's {total} parameter elements ({len(set(owned[rank]))} "
                 f"parameters); a split by size gives each rank about {total / world_size:.0f} (at most "
                 f"{limit:.0f}). Elements per rank: {loads}", rank=rank, world_size=world_size)


def check_state(g, observations: list[dict], full: int, largest: float, world_size: int) -> None:
    limit = full / world_size + largest
    for rank, obs in enumerate(observations):
        held = obs["state_bytes"]
        g.record("state-sharded", held <= limit,
                 f"rank {rank} holds {held} bytes of optimizer state; the unsharded AdamW holds {full}, so a "
                 f"1/{world_size} share is about {full / world_size:.0f} (at most {limit:.0f} allowed)",
                 rank=rank, world_size=world_size)
    total = sum(o["state_bytes"] for o in observations)
    g.record("state-sharded", total >= full,
             f"the ranks together hold {total} bytes of optimizer state, less than the {full} of the "
             "unsharded AdamW: some parameters are never stepped", world_size=world_size)


def check_parameters(g, observations: list[dict], unsharded: dict, world_size: int) -> None:
    for rank, obs in enumerate(observations):
        found = _first_difference(obs["sharded"], unsharded)
        if found is not None:
            g.record("matches-unsharded", False, f"rank {rank}: after {STEPS} steps {found} from the unsharded "
                     "AdamW's", rank=rank, world_size=world_size)
            break
    g.record("matches-unsharded", True)

    first = observations[0]["sharded"]
    for rank, obs in enumerate(observations[1:], start=1):
        found = first_difference(obs["sharded"], first, extra_ok=True)
        if found is not None:
            g.record("params-identical", False,
                     f"after {STEPS} steps {found.name!r} on rank {rank} differs from rank 0's by up to "
                     f"{found.max_abs:.3g}", rank=rank, world_size=world_size)
    g.record("params-identical", True)


def check_zero_grad(g, observations: list[dict], names: list[str], world_size: int) -> None:
    for rank, obs in enumerate(observations):
        left = [names[i] for i, s in enumerate(obs["grads_after_zero_grad"]) if s == "nonzero"]
        g.record("zero-grad", not left,
                 f"rank {rank}: after zero_grad(), {len(left)} of {len(names)} parameters still have a nonzero "
                 f".grad (e.g. {left[:1]}): zero_grad must clear every parameter, not only this rank's own",
                 rank=rank, world_size=world_size)


def _first_difference(got, expected: dict):
    """The first parameter of ``got`` (a rank's record) off the grader's ``expected`` beyond the tolerance: a
    grader.compare.Difference (missing, shape, not a tensor, or values; NaN counts as differing), or None."""
    return first_difference(got, expected, rtol=RTOL, atol=ATOL, extra_ok=True)


def check_scheduled(g, observations: list[dict], unsharded: dict, world_size: int) -> None:
    for rank, obs in enumerate(observations):
        run = obs["scheduled"]
        if run["error"]:
            g.record("lr-change-applies", False, f"rank {rank}: {run['error']}", rank=rank, world_size=world_size)
            return
        found = _first_difference(run["sharded"], unsharded)
        if found is not None:
            g.record("lr-change-applies", False,
                     f"rank {rank}: with a LambdaLR scheduler setting lr = {OPTIMIZER_KWARGS['lr']} / (1 + step) in "
                     f"the ShardedOptimizer's param_groups, after {STEPS} steps {found} from the unsharded AdamW's "
                     "under the same scheduler: the local optimizer did not step with the new learning rate",
                     rank=rank, world_size=world_size)
            return
    g.record("lr-change-applies", True)


def check_owns_nothing(g, observations: list[dict], unsharded: dict, world_size: int) -> None:
    if world_size < 2:
        g.skip("rank-owns-nothing", "needs at least 2 ranks: one alone owns every parameter")
        return
    failed = [(rank, obs["owns_nothing"]) for rank, obs in enumerate(observations) if obs["owns_nothing"]["error"]]
    # A rank that only lost its peer (or timed out waiting for it) is not the cause: name the one that failed first.
    failed.sort(key=lambda item: any(w in item[1]["error"].lower() for w in ("by peer", "timed out", "timeout")))
    if failed:
        rank, run = failed[0]
        g.record("rank-owns-nothing", False, f"with a model of a single parameter on {world_size} ranks, rank {rank} "
                 f"{'(which owns nothing) ' if run.get('owned') == 0 else ''}failed: {run['error']}",
                 rank=rank, world_size=world_size)
        return
    if any(obs["owns_nothing"].get("skipped") for obs in observations):
        g.record("rank-owns-nothing", False, "with a model of a single parameter, a rank could not build its "
                 "ShardedOptimizer", world_size=world_size)
        return
    for rank, obs in enumerate(observations):
        run = obs["owns_nothing"]
        found = _first_difference(run["sharded"], unsharded)
        if found is not None:
            owns = "owns it" if run.get("owned") else "owns nothing"
            g.record("rank-owns-nothing", False,
                     f"with a model of a single parameter on {world_size} ranks, after {STEPS} steps, on rank {rank} "
                     f"(which {owns}), {found} from the unsharded AdamW's", rank=rank, world_size=world_size)
            return
    g.record("rank-owns-nothing", True)
