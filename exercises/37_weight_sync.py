"""Exercise 37: trainer-to-inference weight sync (RL post-training).

In RL post-training one set of ranks trains the policy and another set generates with it: after each
update the trainer's new weights must reach the inference engine. The two hold the same model in
different layouts. The trainer shards it as FSDP2 does: every parameter is cut by rows (Shard(0)) over
the trainer ranks. The inference engine runs it tensor-parallel, as vLLM does: a column-parallel layer
keeps a slice of the output rows on each inference rank, a row-parallel layer a slice of the input
columns, and everything else whole on every inference rank. Every element an inference rank keeps lies
on exactly one trainer rank (the one whose rows hold it), so each trainer rank can send each inference
rank exactly the slices it needs, computed from the two layouts, and nothing else.

    push_weights(model, layout, trainer_ranks, inference_ranks) -> dict | None
        Called on every rank of the default process group. trainer_ranks and inference_ranks are
        disjoint lists of global ranks; the k-th trainer rank is trainer_ranks[k], the j-th inference
        rank inference_ranks[j] (their order in the lists, not their global ranks). T and I are the
        lists' lengths.
        - model: on a trainer rank, the model sharded with torch.distributed.fsdp.fully_shard over a
          DeviceMesh of the trainer ranks: every parameter is a DTensor placed (Shard(0),), and
          p.to_local() is this rank's rows of it. The k-th trainer rank holds rows
          [k * c, min((k + 1) * c, n)) of a parameter with n rows, c = ceil(n / T), as torch.chunk
          cuts (the last ones may hold fewer, or none). On an inference rank: the same model on the
          meta device (names, shapes, dtypes, no values): the engine knows the architecture, the
          weights come from the trainer.
        - layout: {module name: "colwise" or "rowwise"}, module names as model.named_modules() gives
          them, the two styles as Hugging Face models' tensor-parallel plans (base_model_tp_plan, which
          inference engines read through their Transformers backends) name them; torch's
          parallelize_module takes ColwiseParallel() and RowwiseParallel() for the same. A "colwise" module
          (column parallel: the up projections, the head) splits its weight and its bias along dim 0,
          its outputs. A "rowwise" module (row parallel: the down projections) splits its weight along
          dim 1, its inputs, and keeps its bias whole: each rank's partial product has every output,
          so vLLM's RowParallelLinear holds the whole bias on every rank and adds it on one, to be
          counted once in the all-reduced sum. A parameter of a module the layout does not
          name is replicated: every inference rank keeps a whole copy. The j-th inference rank keeps
          part j of I equal parts of a split dimension, [j * size / I, (j + 1) * size / I), as vLLM's
          weight loaders narrow at tp_rank * shard_size (the graded layouts divide evenly, which vLLM
          requires).
        - Returns, on an inference rank, {parameter name: tensor} for every parameter of the model:
          its slice in the inference layout, in the parameter's dtype, on this rank's device (the CPU
          with gloo; torch.cuda.current_device() with nccl). On a trainer rank: None.
        - Messages: point to point only (dist.send / dist.recv, isend / irecv, batch_isend_irecv),
          each from a trainer rank to an inference rank. Each element an inference rank keeps
          travels once, from the trainer rank that holds its row; a replicated parameter reaches every
          inference rank, each trainer rank sending its rows to each (every rollout rank gets its own
          copy in verl's and OpenRLHF's syncs too). Nothing else travels: no
          collective (not even a barrier), no sizes or offsets (both sides compute every slice from
          the shapes, the layout and the two lists), so the bytes sent are exactly the bytes the
          inference layout holds.
        - Memory: no rank ever holds a whole parameter it does not keep: a trainer rank never gathers
          one (no full_tensor(), no redistribute to Replicate), and an inference rank never receives
          one whole to cut its slice out.

Where this departs from the RL stacks, and why: verl's FSDP engine yields each parameter whole
(DTensor.full_tensor()) and its NCCL checkpoint engine broadcasts it in buckets from trainer rank 0 to
every rollout rank, whose vLLM weight loader then narrows out its slice; OpenRLHF gathers each
parameter (DeepSpeed's GatheredParameters) and broadcasts it from rank 0 to the vLLM workers. Both
are simple and hold each parameter whole, one at a time, on every trainer rank; a split parameter then
travels whole to each of the I inference ranks, I times what they keep. Here each slice is cut where it
lies, on the trainer, and goes only to the rank that keeps it: the resharding vLLM's loaders do after
the broadcast, done before the send.

The grader starts the ranks and the process group (gloo on CPU), splits the world into trainer and
inference ranks (4 ranks: [0, 1] and [2, 3]; 3 ranks: [0] and [1, 2], then [1, 2] and [0]), shards a
small model over the trainer ranks with fully_shard, and calls push_weights on every rank, twice per
split: the usual layout in float32 and another in float64. It compares every returned slice with the
trainer's weights bit for bit, counts the bytes each rank sends and to whom, and looks for whole
parameters in what each rank holds after every message.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/37_weight_sync.py      (stuck? ddp-grade hint 37)
"""

import torch
import torch.distributed as dist


def push_weights(model, layout, trainer_ranks, inference_ranks):
    # TODO: for each parameter, work out the rows each trainer rank holds (FSDP2's Shard(0), as torch.chunk
    # cuts) and the slice each inference rank keeps (the layout: dim 0 for colwise, dim 1 of a rowwise
    # weight, whole otherwise); every trainer rank sends each inference rank the overlap, point to point,
    # and each inference rank receives it into its slice. Return the slices on an inference rank, None on
    # a trainer rank.
    raise NotImplementedError
