"""Exercise 42: napkin math, part 2: what each GPU sends, and how long a step takes.

    communication(model: ModelSpec, plan: Plan) -> Traffic
    step_time(model: ModelSpec, plan: Plan, cluster: Cluster) -> StepTime

The transformer, the plan and rank 0 are exercise 41's (read its docstring and its
Transformer): rank 0 is the first pipeline stage, tensor-parallel rank 0,
data-parallel rank 0, and ranks are ordered tensor-parallel innermost, then data,
then pipeline: rank = (pp_index * dp + dp_index) * tp + tp_index. e is the element
size of the parameters, gradients and activations (2 under "bf16-mixed", 4 under "fp32").

communication: the bytes rank 0 sends in one step, per parallel dimension ("dp", "tp",
"pp": Traffic's fields) and per collective ("all-reduce", "reduce-scatter",
"all-gather", "send": the keys of each dict; leave out what is not sent). Collectives
run as rings: over n ranks a rank sends 2(n-1)/n of the buffer in an all-reduce and
(n-1)/n of the whole buffer in a reduce-scatter or an all-gather; a send sends it all.
What runs, per step:
  - dp (only when dp > 1), over the flat buffer of rank 0's local parameters (P
    elements; for ZeRO padded to dp * ceil(P / dp)):
      ZeRO 0: one all-reduce of the gradients (P elements, not padded);
      ZeRO 1: one reduce-scatter of the gradients, then one all-gather of the updated
              parameters;
      ZeRO 2: a reduce-scatter after every micro-batch's backward (the whole gradient is
              not kept), then one all-gather of the updated parameters;
      ZeRO 3: an all-gather of the parameters before every micro-batch's forward and
              again before its backward, a reduce-scatter after it; no all-gather after
              the step.
  - tp (only when tp > 1): per layer and micro-batch, two all-reduces of the
    activations (micro_batch x seq_len x hidden elements) in forward, after out and
    after fc2, and their two conjugates in backward, before QKV and fc1; a layer
    recomputed whole ("full") runs its forward's two again.
  - pp (only when pp > 1): the first stage sends one activation (micro_batch x
    seq_len x hidden) per micro-batch (it receives the gradients, it does not send them).

step_time: one step of rank 0 on `cluster`:
  flops        the matmul FLOPs rank 0 computes (what torch.utils.flop_counter counts):
               a forward of one layer on one micro-batch is 2 b s (12 h^2) + 4 b s^2 h
               (QK^T and times V), divided by tp; a backward is twice its forward;
               "full" recomputes each layer's forward once more, "selective" the 4 b s^2 h
               of the attention core. The head (h x V, on the last stage, whole on every
               tensor-parallel rank) costs 2 b s h V forward and twice that backward;
               embeddings are lookups.
  compute_s    flops / (peak_flops * mfu), and at half that rate under "fp32"
  dp_s, tp_s, pp_s   the time of that dimension's collectives: for each call,
               bytes sent / bandwidth + latency * (messages in sequence: 2(n-1) for an
               all-reduce, n-1 for a reduce-scatter or all-gather, 1 for a send). A group
               uses the node's links when its ranks fit in one node (a tp group spans tp
               consecutive ranks, a dp group tp * dp, a pp group tp * dp * pp; compare
               with gpus_per_node), and the links between nodes otherwise.
  bubble_s     a pipeline idles (pp - 1) / (micro_batches + pp - 1) of its time (GPipe and
               1F1B alike): with busy = compute_s + tp_s + pp_s, bubble_s = busy *
               (pp - 1) / micro_batches.
  exposed_dp_s data-parallel communication overlaps compute: only max(0, dp_s - compute_s)
               adds to the step.
  total_s      busy + bubble_s + exposed_dp_s
A plan that cannot run raises ValueError (41's reasons), and step_time also when
dp * tp * pp is not cluster.gpus.

The traffic and time of 41's GPT-style plans. Frontier runs add sequence parallelism
(all-gathers and reduce-scatters where tensor parallelism all-reduces), context
parallelism (K and V gathered), interleaved stages (a bubble divided by the virtual
stages, more sends), uneven stages (the busiest stage sets the pace) and experts
(all-to-alls); the exercise leaves them out to stay an hour's work. Once 41 and 42
pass, `ddp-grade plan` costs them with the same counts and adds what one efficiency
hides (each matmul's efficiency from its shape, memory-bound work, the traffic compute
cannot hide, the slowest of many ranks); `ddp-grade plan --published` shows it beside
published runs it was not fitted to, and `--compute-efficiency` gives your model's
answer. docs/capacity.md says each term.

Grade it:  ddp-grade exercises/42_traffic.py
The grader runs a dozen plans for real on 2 to 4 processes and compares your bytes
with every collective each rank made (exactly) and your FLOPs with FlopCounterMode's,
then your step times with the kit's cost model at scale (GPipe's bubble, the ring's
2(n-1)/n).
"""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    layers: int      # L
    hidden: int      # h
    heads: int       # a
    vocab: int       # V
    seq_len: int     # s


@dataclass(frozen=True)
class Plan:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0                  # ZeRO stage 0-3 over the data-parallel ranks
    micro_batch: int = 1           # b: sequences per micro-batch
    micro_batches: int = 1         # m: micro-batches per step on each data-parallel rank
    schedule: str = "1f1b"         # "gpipe" or "1f1b"
    precision: str = "bf16-mixed"  # or "fp32"
    recompute: str = "none"        # "none", "selective" or "full"


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    peak_flops: float            # per GPU, dense bf16, FLOP/s
    mfu: float                   # the fraction of peak compute achieves
    memory_bytes: float          # per GPU
    intra_node_bandwidth: float  # bytes/s a GPU sends to a GPU of its node
    inter_node_bandwidth: float  # bytes/s a GPU sends to a GPU of another node
    intra_node_latency: float    # seconds per message inside a node
    inter_node_latency: float    # seconds per message between nodes


@dataclass
class Traffic:
    dp: dict = field(default_factory=dict)   # {"all-reduce": bytes, ...} rank 0 sends per step
    tp: dict = field(default_factory=dict)
    pp: dict = field(default_factory=dict)


@dataclass
class StepTime:
    flops: float
    compute_s: float
    dp_s: float
    tp_s: float
    pp_s: float
    bubble_s: float
    exposed_dp_s: float
    total_s: float


def communication(model: ModelSpec, plan: Plan) -> Traffic:
    # TODO: list the collectives of each dimension (how many calls, how big a buffer),
    # then multiply by the ring's share each rank sends.
    raise NotImplementedError


def step_time(model: ModelSpec, plan: Plan, cluster: Cluster) -> StepTime:
    # TODO: FLOPs -> compute time; each collective -> bandwidth and latency on its link;
    # then the bubble and what of the data-parallel time compute cannot hide.
    raise NotImplementedError
