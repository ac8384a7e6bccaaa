"""What a plan may be and where each layer runs (part of :mod:`grader.capacity`, which re-exports it):
the checks on a model and a plan, the layers of each pipeline rank's chunks, and the order in which a
pipeline rank runs its micro-batches (GPipe, 1F1B, Megatron-LM's interleaved 1F1B). Pure Python; read
by the cost model and by the real runs that hold it to measurement (the same schedule in both)."""

from __future__ import annotations

# model and plan below are grader.capacity's ModelSpec and Plan (read by attribute: this module imports nothing).

SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("bf16-mixed", "fp32", "fp8-mixed")
RECOMPUTES = ("none", "selective", "full")
ATTENTIONS = ("explicit", "flash")


class PlanError(ValueError):
    """A plan that cannot run on this model (sizes that do not divide, a combination refused)."""


# --- the model's sizes -------------------------------------------------------------------------------------


def kv_heads(model) -> int:
    return model.kv_heads or model.heads


def ffn(model) -> int:
    return model.ffn or 4 * model.hidden


def expert_ffn(model) -> int:
    return model.expert_ffn or ffn(model)


def is_moe(model, layer: int) -> bool:
    return model.experts > 0 and layer >= model.dense_layers


# --- checks on input -----------------------------------------------------------------------------------


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise PlanError(message)


def validate(model, plan, world_size: int | None = None) -> None:
    """Raise PlanError, saying what and why, when ``plan`` cannot run ``model``."""
    for name in ("layers", "hidden", "heads", "vocab", "seq_len"):
        _require(getattr(model, name) >= 1, f"model.{name} must be at least 1, not {getattr(model, name)}")
    _require(model.hidden % model.heads == 0, f"hidden {model.hidden} is not divisible by heads {model.heads}")
    for name in ("kv_heads", "ffn", "experts", "expert_ffn", "shared_experts", "dense_layers"):
        _require(getattr(model, name) >= 0, f"model.{name} must be at least 0, not {getattr(model, name)}")
    _require(model.heads % kv_heads(model) == 0, f"kv_heads {kv_heads(model)} does not divide heads {model.heads}")
    _require(model.mlp in ("gelu", "swiglu"), f"model.mlp must be gelu or swiglu, not {model.mlp!r}")
    _require(model.norm in ("layernorm", "rmsnorm"), f"model.norm must be layernorm or rmsnorm, not {model.norm!r}")
    _require(model.positions in ("learned", "rope"), f"model.positions must be learned or rope, not {model.positions!r}")
    if model.experts:
        _require(1 <= model.top_k <= model.experts, f"top_k {model.top_k} must be between 1 and {model.experts} experts")
    for name in ("dp", "tp", "pp", "micro_batch", "micro_batches", "cp", "vpp", "ep"):
        _require(getattr(plan, name) >= 1, f"plan.{name} must be at least 1, not {getattr(plan, name)}")
    _require(plan.zero in (0, 1, 2, 3), f"plan.zero must be 0, 1, 2 or 3, not {plan.zero}")
    for name, allowed in (("schedule", SCHEDULES), ("precision", PRECISIONS), ("recompute", RECOMPUTES),
                          ("attention", ATTENTIONS)):
        _require(getattr(plan, name) in allowed,
                 f"plan.{name} must be one of {', '.join(allowed)}, not {getattr(plan, name)!r}")
    t, chunks = plan.tp, plan.pp * plan.vpp
    _require(model.heads % t == 0, f"tensor-parallel size {t} does not divide {model.heads} heads")
    _require(kv_heads(model) % t == 0, f"tensor-parallel size {t} does not divide {kv_heads(model)} kv heads")
    _require(ffn(model) % t == 0 and expert_ffn(model) % t == 0, f"tensor-parallel size {t} does not divide the ffn size")
    if plan.stage_layers:
        layout = tuple(plan.stage_layers)
        _require(len(layout) == chunks and all(isinstance(n, int) and n >= 0 for n in layout),
                 f"stage_layers needs {chunks} counts (pp x vpp) of 0 or more layers, not {len(layout)}")
        _require(sum(layout) == model.layers, f"stage_layers add up to {sum(layout)}, not {model.layers} layers")
    elif plan.vpp == 1:
        _require(model.layers % plan.pp == 0, f"{plan.pp} pipeline stages do not divide {model.layers} layers")
    else:
        _require(model.layers % chunks == 0,
                 f"{plan.pp} x {plan.vpp} virtual stages do not divide {model.layers} layers")
    if plan.vpp > 1:
        _require(plan.pp > 1 and plan.schedule == "1f1b", "virtual stages interleave a 1f1b pipeline of 2 stages or more")
        _require(plan.micro_batches % plan.pp == 0, f"interleaving needs micro_batches ({plan.micro_batches}) to be a "
                                                    f"multiple of pp ({plan.pp})")
    _require(not plan.sp or plan.vocab_parallel or t == 1,
             "sequence parallelism keeps no whole tensor on a rank: it needs vocab_parallel embeddings and head")
    sequence = model.seq_len // plan.cp
    _require(model.seq_len % plan.cp == 0, f"context-parallel size {plan.cp} does not divide seq_len {model.seq_len}")
    _require(not plan.sp or sequence % t == 0, f"sequence parallelism splits {sequence} tokens over {t} ranks: it must divide")
    _require(plan.cp == 1 or plan.attention == "flash", "context parallelism needs attention='flash'")
    _require(plan.cp_comm in ("all-gather", "ring"), f"plan.cp_comm must be all-gather or ring, not {plan.cp_comm!r}")
    _require(not (plan.attention == "flash" and plan.recompute == "selective"),
             "flash attention keeps no scores already: recompute 'selective' has nothing to drop")
    _require(not plan.vocab_parallel or model.vocab % t == 0, f"tensor-parallel size {t} does not divide vocab {model.vocab}")
    if plan.ep > 1 or model.experts:
        _require(model.experts > 0 and plan.tp == 1, "experts over ranks need an MoE model, and MoE layers tp 1")
        _require(model.experts % plan.ep == 0, f"expert-parallel size {plan.ep} does not divide {model.experts} experts")
        _require(plan.dp % plan.ep == 0, f"expert-parallel size {plan.ep} does not divide dp {plan.dp}")
        _require(plan.cp == 1, "context and expert parallelism together are left out")
        _require(plan.capacity_factor > 0, f"capacity_factor must be above 0, not {plan.capacity_factor}")
    if world_size is not None:
        _require(plan.world_size == world_size,
                 f"dp x tp x pp{' x cp' if plan.cp > 1 else ''} = {plan.dp} x {plan.tp} x {plan.pp}"
                 f"{f' x {plan.cp}' if plan.cp > 1 else ''} = {plan.world_size}, not the world size {world_size}")


# --- the pipeline: which layers each rank holds, and the order it runs micro-batches -------------------------


def layout(model, plan) -> tuple:
    """Layers of each virtual stage, in order (virtual stage j runs on pipeline rank j % pp, chunk j // pp)."""
    if plan.stage_layers:
        return tuple(plan.stage_layers)
    chunks = plan.pp * plan.vpp
    return (model.layers // chunks,) * chunks


def chunk_layers(model, plan, rank: int = 0) -> list[list[int]]:
    """The global indices of the layers of each of ``rank``'s chunks."""
    counts, start, out = layout(model, plan), 0, []
    for j, n in enumerate(counts):
        if j % plan.pp == rank:
            out.append(list(range(start, start + n)))
        start += n
    return out


def schedule(plan, rank: int = 0) -> list[tuple[str, int, int]]:
    """[("F" or "B", micro-batch, chunk)] of pipeline rank ``rank``. GPipe: every forward, then every
    backward. 1F1B: min(pp - rank - 1, m) forwards of warm-up, then a forward and a backward in turn, then
    the backwards left. Interleaved (vpp > 1, Megatron-LM's): (pp - rank - 1) x 2 + (vpp - 1) x pp chunk
    forwards of warm-up (every one when m == pp), forwards taking groups of pp micro-batches through chunks
    0, 1, ..., backwards the same groups through the chunks in reverse."""
    m, p, v = plan.micro_batches, plan.pp, plan.vpp
    if plan.schedule == "gpipe":
        return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]
    if v == 1:
        warm = min(p - rank - 1, m)
        ops = [("F", j, 0) for j in range(warm)]
        for j in range(m - warm):
            ops += [("F", warm + j, 0), ("B", j, 0)]
        return ops + [("B", j, 0) for j in range(m - warm, m)]
    total = m * v

    def item(k: int, forward: bool) -> tuple[str, int, int]:
        chunk = k % (p * v) // p
        return ("F" if forward else "B", k // (p * v) * p + k % p, chunk if forward else v - 1 - chunk)

    warm = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    ops = [item(k, True) for k in range(warm)]
    for k in range(total - warm):
        ops += [item(warm + k, True), item(k, False)]
    return ops + [item(k, False) for k in range(total - warm, total)]


def in_flight(plan, stage: int = 0) -> int:
    """Micro-batches whose activations a stage holds at its peak (GPipe: all; 1F1B: at most the stages from
    this one to the last), for one chunk per rank."""
    if plan.schedule == "gpipe":
        return plan.micro_batches
    return min(plan.pp - stage, plan.micro_batches)


def peak_in_flight(plan, weights: list[int], rank: int = 0) -> int:
    """The most of sum(weights[chunk] for each (micro-batch, chunk) whose forward ran and backward has not),
    over ``rank``'s schedule, sampled after every forward and backward."""
    if plan.vpp == 1:
        return in_flight(plan, rank) * weights[0]
    held = peak = 0
    for op, _, chunk in schedule(plan, rank):
        held += weights[chunk] if op == "F" else -weights[chunk]
        peak = max(peak, held)
    return peak
