"""Exercise 01: setup_ddp / cleanup_ddp.

Rank side: call the learner's setup_ddp with probes on init_process_group,
try a collective, clean up twice. Parent side: decide each check from that.
"""

from __future__ import annotations

import torch

from grader.catalog import CLAIM
from grader.rank import probes
from grader.checks.interface import Grader
from grader.rank.drivers.ex01_setup import defaults_main, rank_main

MAX_TIMEOUT_S = 300.0
# gloo's all-reduce of one float32: at least one message from each rank, 96 bytes of header and its 4 bytes
# (grader.traffic measured 96 bytes of headers a message); opening a connection alone sends 8.
ALL_REDUCE_MESSAGE_BYTES = 96 + 4
LOCAL_ADDRESSES = ("127.0.0.1", "localhost")  # what MASTER_ADDR may default to: both meet on this machine


def requested_backend(default: str) -> str:
    """A backend setup_ddp would not pick by itself: it must pass the one it is given through.

    On a GPU machine that is gloo; on CPU, where gloo is the only choice, the
    device-qualified spelling "cpu:gloo", which init_process_group accepts and
    dist.get_backend() reports back as given.
    """
    return "gloo" if default == "nccl" else "cpu:gloo"


def grade(g: Grader) -> None:
    backend = g.backend if g.backend_requested != "auto" else None
    # backend= given: it is the one to join with, even where setup_ddp would pick another.
    request = requested_backend(g.backend)
    first = g.world_sizes[0]
    counted = g.backend != "nccl"  # gloo's bytes between the ranks go over TCP, where the kernel counts them
    outcomes = g.run_at_once(
        [g.Run(rank_main, world_size, {"backend": backend}, traffic=counted) for world_size in g.world_sizes]
        + [g.Run(rank_main, first, {"backend": request, "observe_errors": True}, traffic=True),
           g.Run(defaults_main, 1, env={"MASTER_ADDR": None, "MASTER_PORT": None},
                 label="setup_ddp with MASTER_ADDR and MASTER_PORT unset (not run, only recorded)")])
    for world_size in g.world_sizes:
        outcome = next(outcomes)
        check_run(g, outcome.results(), world_size, counted=outcome.traffic)
    outcome = next(outcomes)
    check_requested_backend(g, outcome.results(), request, first, outcome.traffic)
    check_defaults(g, next(outcomes).results()[0])


def check_requested_backend(g, observations: list[dict], request: str, world_size: int, counted=None) -> None:
    for rank, obs in enumerate(observations):
        if obs.get("setup_error"):
            g.record("backend", False, f"rank {rank}: setup_ddp(rank, world_size, backend={request!r}) raised "
                     f"{obs['setup_error']}; init_process_group accepts that backend: pass it through as given",
                     rank=rank, world_size=world_size)
            return
    check_run(g, observations, world_size, expected_backend=request, counted=counted)


def check_run(g, observations: list[dict], world_size: int, expected_backend: str | None = None,
              counted=None) -> None:
    first_abort = next((o for o in observations if o["aborted"]), None)
    port_ok = True
    for rank, obs in enumerate(observations):
        call = obs["calls"][-1] if obs["calls"] else None
        if call is not None and not call["uses_store"] and call["master_port"] != obs["grader_port"]:
            port_ok = g.record("port-from-env", False,
                               f"rank {rank} asked init_process_group to meet at port {call['master_port']}, "
                               f"but MASTER_PORT was {obs['grader_port']}: the port is hard-coded",
                               rank=rank, world_size=world_size)
            break
    if port_ok:
        g.record("port-from-env", True)
    if first_abort is not None:
        raise_not_run(g, first_abort["aborted"])

    for rank, obs in enumerate(observations):
        if not obs["calls"]:
            g.record("timeout-set", False, f"rank {rank}: setup_ddp never called init_process_group",
                     rank=rank, world_size=world_size)
            continue
        timeout = obs["calls"][-1]["timeout_s"]
        if timeout is None:
            g.record("timeout-set", False, "init_process_group was called without timeout=, so a deadlock "
                     "waits for the default (30 minutes on gloo)", rank=rank, world_size=world_size)
        elif timeout > MAX_TIMEOUT_S:
            g.record("timeout-set", False, f"timeout is {timeout:g} s; at most {MAX_TIMEOUT_S:g} s is expected",
                     rank=rank, world_size=world_size)
        else:
            g.record("timeout-set", True)

    if not all(o.get("initialized") for o in observations):
        rank = next(r for r, o in enumerate(observations) if not o.get("initialized"))
        g.record("joins-group", False, f"rank {rank}: no process group after setup_ddp returned",
                 rank=rank, world_size=world_size)
        raise_not_run(g, "setup_ddp did not initialize the group")

    for rank, obs in enumerate(observations):
        if obs["rank"] != rank or obs["world_size"] != world_size:
            g.record("joins-group", False, f"the process started as rank {rank} of {world_size} joined as "
                     f"rank {obs['rank']} of {obs['world_size']}", rank=rank, world_size=world_size)
    g.record("joins-group", True)

    expected = expected_backend or g.backend
    for rank, obs in enumerate(observations):
        if expected_backend is not None:
            why = (f": setup_ddp(rank, world_size, backend={expected_backend!r}) must join with the backend it "
                   "is given, not pick its own")
        else:
            why = " (gloo, since there are not enough GPUs here)" if expected == "gloo" else ""
        g.record("backend", obs["backend"] == expected,
                 f"rank {rank} joined with {obs['backend']}, expected {expected}{why}",
                 rank=rank, world_size=world_size)

    check_collective(g, observations, world_size, counted)

    for rank, obs in enumerate(observations):
        g.record("cleanup-destroys", not obs["initialized_after_cleanup"],
                 f"rank {rank}: the group is still initialized after cleanup_ddp()", rank=rank,
                 world_size=world_size)
        g.record("cleanup-twice", obs["second_cleanup_error"] is None,
                 f"rank {rank}: a second cleanup_ddp() raised {obs['second_cleanup_error']}", rank=rank,
                 world_size=world_size)

    if expected_backend is not None:  # the grader's own request (gloo on a GPU machine): no GPU to check
        return
    if g.backend != "nccl":
        g.skip("nccl-device", "runs with --backend nccl on GPUs only")
        return
    devices = [o.get("cuda_device") for o in observations]
    count = torch.cuda.device_count()
    for rank, device in enumerate(devices):
        g.record("nccl-device", device == rank % count,
                 f"rank {rank} used cuda:{device}, expected cuda:{rank % count} "
                 f"(devices of all ranks: {devices})", rank=rank, world_size=world_size)


def check_collective(g, observations: list[dict], world_size: int, counted=None) -> None:
    """collective-works: the sum each rank says it got names a wrong one (a claim); what decides is what the
    kernel counted (``counted``, a grader.traffic.RunTraffic): every rank sent the others at least one message
    of gloo's all-reduce, which a group that exists only in the ranks' records never does. Where the kernel's
    counters cannot be read (NCCL, or a kernel that refuses them), the sums alone decide, as a claim."""
    total = world_size * (world_size + 1) / 2
    for rank, obs in enumerate(observations):
        if obs["all_reduce"] != total:
            g.record("collective-works", False,
                     f"rank {rank}: all_reduce of rank + 1 gave {obs['all_reduce']:g}, expected {total:g}",
                     rank=rank, world_size=world_size, evidence=CLAIM)
            return
    if counted is None or world_size < 2:  # a group of one sends nothing: the kernel has nothing to count
        g.record("collective-works", True, evidence=CLAIM)
        return
    for rank in range(world_size):
        if rank in counted.uncounted():
            why = ("its process never let the grader read its sockets (it asks as its group is made and destroyed, "
                   "and as the run ends)")
        elif counted.out_of(rank) < ALL_REDUCE_MESSAGE_BYTES:
            why = (f"it sent the other ranks {counted.out_of(rank):,} bytes (the kernel's count): an all-reduce over a "
                   f"group that joined sends each of them at least one message ({ALL_REDUCE_MESSAGE_BYTES} bytes)")
        else:
            continue
        g.record("collective-works", False, f"rank {rank} says its all_reduce gave {total:g}, but {why}",
                 rank=rank, world_size=world_size)
        return
    g.record("collective-works", True)


def check_defaults(g, obs: dict) -> None:
    error = obs["cleanup_without_group_error"]
    g.record("cleanup-twice", error is None, f"cleanup_ddp() with no group initialized raised {error}")
    if not obs["calls"]:
        g.record("default-address", False, "setup_ddp did not call init_process_group")
        return
    call = obs["calls"][-1]
    if call["uses_store"]:
        g.record("default-address", False, "setup_ddp passed its own store= instead of using the environment")
        return
    addr, port = call["master_addr"], call["master_port"]
    g.record("default-address", addr in LOCAL_ADDRESSES and port == "29500",
             f"with MASTER_ADDR and MASTER_PORT unset, setup_ddp would meet at {addr}:{port}, "
             "expected 127.0.0.1:29500 (or localhost:29500)")


def raise_not_run(g, reason: str) -> None:
    g.stop(reason)
