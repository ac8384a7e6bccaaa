"""``ddp-grade plan``: ask the kit's cost model about a parallel training plan (:mod:`grader.commands.plan`
answers, :mod:`grader.commands.plan_text` puts the answer into words)."""

from __future__ import annotations

import json

import click

from grader import capacity
from grader import capacity_plans as plans
from grader import capacity_published as published
from grader.commands import plan_text
from grader.commands.plan import (GB, answer_for, check_only_published, normalised, published_rows, refusal,
                                  summary)
from grader.exits import EXIT_FAILED, EXIT_OK, EXIT_UNUSABLE
from grader.progress import Progress

H = plans.H100


def _fail(message: str, code: int = EXIT_UNUSABLE):
    click.echo(f"ddp-grade plan: error: {message}", err=True)
    raise SystemExit(code)


@click.command("plan")
@click.option("--layers", type=int, help="Transformer layers.")
@click.option("--hidden", type=int, help="Hidden size.")
@click.option("--heads", type=int, help="Attention heads.")
@click.option("--vocab", type=int, help="Vocabulary size.")
@click.option("--seq-len", type=int, help="Tokens per sequence.")
@click.option("--kv-heads", type=int, help="Key and value heads (grouped-query attention; default: --heads).")
@click.option("--ffn", type=int, help="The MLP's width (default 4 x --hidden).")
@click.option("--mlp", help="gelu (fc1, GELU, fc2; default) or swiglu (gate, up, SiLU(gate) x up, down).")
@click.option("--norm", help="layernorm (default) or rmsnorm.")
@click.option("--bias/--no-bias", default=None, help="Biases in the layers' linear maps (default: with).")
@click.option("--positions", help="learned (a position embedding; default) or rope (none).")
@click.option("--dropout/--no-dropout", default=None, help="Dropout in the layers (default: with).")
@click.option("--experts", type=int, help="Routed experts of each MoE layer (default 0: dense).")
@click.option("--top-k", type=int, help="Experts each token is routed to (default 1).")
@click.option("--expert-ffn", type=int, help="An expert's MLP width (default --ffn).")
@click.option("--shared-experts", type=int, help="Experts every token passes through (default 0).")
@click.option("--dense-layers", type=int, help="Leading layers that keep a dense MLP (default 0).")
@click.option("--dp", type=int, help="Data-parallel size (default 1).")
@click.option("--tp", type=int, help="Tensor-parallel size (default 1).")
@click.option("--pp", type=int, help="Pipeline stages (default 1).")
@click.option("--zero", type=int, help="ZeRO stage 0-3 (default 0).")
@click.option("--micro-batch", type=int, help="Sequences per micro-batch (default 1).")
@click.option("--micro-batches", type=int, help="Micro-batches per step (default 1).")
@click.option("--schedule", help=f"Pipeline schedule: {', '.join(capacity.SCHEDULES)} (default 1f1b).")
@click.option("--precision", help=f"{', '.join(capacity.PRECISIONS)} (default bf16-mixed; fp8-mixed: the layers' "
              "linear maps in float8, H100 only).")
@click.option("--recompute", help=f"Activation recomputation: {', '.join(capacity.RECOMPUTES)} (default none).")
@click.option("--sp", is_flag=True, default=None, help="Sequence parallelism in the tensor-parallel group.")
@click.option("--cp", type=int, help="Context-parallel size (default 1).")
@click.option("--cp-comm", help="Context parallelism's K and V: all-gather (default) or ring.")
@click.option("--vpp", type=int, help="Virtual stages (model chunks) per pipeline rank (default 1).")
@click.option("--stage-layers", help="Layers of each virtual stage in order, e.g. 7,8x14,7 or 0,1x126,0.")
@click.option("--vocab-parallel", is_flag=True, default=None, help="Embeddings and head split over tp.")
@click.option("--attention", help=f"{', '.join(capacity.ATTENTIONS)} (default explicit).")
@click.option("--ep", type=int, help="Expert-parallel size (default 1).")
@click.option("--capacity-factor", type=float, help="An expert's slots per rank, times tokens x top_k / experts.")
@click.option("--scatter-gather", is_flag=True, default=None,
              help="Pipeline sends split over tp and gathered in the node (Megatron-LM 2021).")
@click.option("--no-dp-overlap", "no_dp_overlap", is_flag=True, default=None,
              help="Data-parallel traffic after the last backward, not under compute.")
@click.option("--no-tp-overlap", "no_tp_overlap", is_flag=True, default=None,
              help="Backward's tensor-parallel collectives wait, none under the weight gradients' products "
                   "(Megatron-LM before 2022).")
@click.option("--grad-fp32", is_flag=True, default=None,
              help="Gradients accumulated and reduced over dp in float32 (Llama 3).")
@click.option("--tp-comm-overlap", is_flag=True, default=None,
              help="Every tensor-parallel collective in chunks under the layer's products, forward too "
                   "(Transformer Engine's userbuffers, as NeMo's performance recipes run).")
@click.option("--pp-overlap", is_flag=True, default=None,
              help="Pipeline sends and receives beside the compute (Megatron-core's overlap_p2p_comm).")
@click.option("--scenario", metavar="NAME",
              help="A scenario: " + "; ".join(f'"{k}"' for k in [*plans.SCENARIOS, *plans.FRONTIER])
              + ". Its best plan, or the plan given.")
@click.option("--best", is_flag=True,
              help="Search the fastest plan that fits (needs --gpus and --global-batch-tokens).")
@click.option("--search", "rules", type=click.Choice(["kit", "43"]),
              help="The search: the kit's planner, or 43's rules (default: 43's for 43's scenarios).")
@click.option("--published", "show_published", is_flag=True,
              help="Every published figure the cost model is held to, beside the kit's, with its command.")
@click.option("--global-batch-tokens", type=int, help="Tokens per optimizer step (the search's batch; for one plan, "
              "checked against dp x micro-batch x micro-batches x seq-len).")
@click.option("--gpu", type=click.Choice(list(plans.GPU_KINDS)), help="The GPU kind (default H100).")
@click.option("--gpus", type=int, help="GPUs of the cluster (default: dp x tp x pp x cp).")
@click.option("--gpus-per-node", type=int, help=f"Default {H.gpus_per_node}.")
@click.option("--peak-tflops", type=float, help=f"Dense bf16 peak per GPU (default {H.peak_flops / 1e12:g}).")
@click.option("--compute-efficiency", "--mfu", "mfu", type=float,
              help="The fraction of peak every FLOP runs at, as 42's step time has it (--mfu is the old name); left "
                   "out, the kit's model times each matmul from its shape. Not the answer's mfu, which is achieved.")
@click.option("--memory-gb", type=float, help=f"Memory per GPU, GB (default {H.memory_bytes / GB:g}).")
@click.option("--intra-gbps", type=float,
              help=f"GB/s to a GPU of the same node (default {H.intra_node_bandwidth / GB:g}).")
@click.option("--inter-gbps", type=float,
              help=f"GB/s to a GPU of another node (default {H.inter_node_bandwidth / GB:g}).")
@click.option("--intra-latency-us", type=float,
              help=f"Per message inside a node (default {H.intra_node_latency * 1e6:g}).")
@click.option("--inter-latency-us", type=float,
              help=f"Per message across nodes (default {H.inter_node_latency * 1e6:g}).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as one JSON object (bytes, seconds, FLOPs).")
def plan_command(scenario, best, rules, show_published, global_batch_tokens, gpu, gpus, as_json, **given):
    """Ask the kit's cost model about a parallel training plan (opens once 41 and 42 pass;
    --published, the published runs it is held to, opens at once).

    Shows rank 0's memory (params, grads, optimizer, activations; whether it fits), the bytes it
    sends per step for each dimension and collective, the step time (compute, communication,
    bubble; MFU, tokens/s per GPU) and what limits the plan. The cluster is an H100 one unless told.

    \b
    Examples:
      ddp-grade plan --layers 32 --hidden 4096 --heads 32 --vocab 128256 --seq-len 8192 \\
          --dp 8 --tp 8 --zero 1 --micro-batches 8 --recompute selective
      ddp-grade plan --scenario "70B on 1,024 GPUs"
      ddp-grade plan --scenario "Llama 3 405B on 16,384 GPUs" --best
      ddp-grade plan --published

    Exit 0 when the cost model answered (a plan that does not fit is an answer too), 1 while
    41 and 42 have not both passed (a plan of your own; --published answers before), 2 for a
    plan, scenario or option it cannot use.
    """
    progress = Progress()
    if progress.warning():
        click.echo(progress.warning(), err=True)
    refused = refusal(progress)
    if refused and not show_published:
        click.echo(refused, err=True)
        raise SystemExit(EXIT_FAILED)
    try:
        if show_published:
            check_only_published(scenario, best, given)
            rows = published_rows()
            click.echo(json.dumps(rows, indent=2) if as_json else
                       plan_text.render_published(rows, summary(rows), published.READINGS))
            raise SystemExit(EXIT_OK)
        data = answer_for(scenario, best, rules, global_batch_tokens, gpu, gpus, normalised(given))
    except capacity.PlanError as exc:
        _fail(str(exc))
    click.echo(json.dumps(data, indent=2) if as_json else plan_text.render_text(data))
    raise SystemExit(EXIT_OK)
