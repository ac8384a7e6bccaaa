"""Exercise 15: a training script that survives a dead worker, under torchrun.

On a real cluster a worker dies: a node is preempted, a process runs out of
memory, a machine reboots. torchrun (torch.distributed.run) notices, stops the
other workers, and, if restarts are left, starts all of them again. The new
workers begin at main() with nothing in memory. The script must notice the
snapshot it wrote and continue from it, so the hours before the failure are
not lost.

torchrun starts one worker process per --nproc-per-node on each node and sets,
in each, RANK (global), LOCAL_RANK (on this node), WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK (the node's number), MASTER_ADDR, MASTER_PORT
and TORCHELASTIC_RESTART_COUNT. Your script reads them; it never starts
processes itself. Two nodes of two workers each, on two machines:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST_OF_NODE_0:29400 --rdzv-id job15 --max-restarts 1 \\
        15_elastic.py --snapshot /shared/snapshot.pt

and on one machine, unchanged:

    torchrun --nnodes 1 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 --max-restarts 1 15_elastic.py --snapshot snapshot.pt

(With torch 2.13, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's
environment, or the restarted workers cannot form their group; the grader
does. docs/elastic.md says why, and what changes on real machines and GPUs.)

    main() -> None
        - Join the default process group from the environment
          (init_process_group(backend) with the default env:// rendezvous):
          nccl when every local rank has a GPU of its own
          (torch.cuda.device_count() >= LOCAL_WORLD_SIZE), else gloo. With
          nccl, each worker uses GPU LOCAL_RANK.
        - Build the model with build_model(), wrap it in
          DistributedDataParallel, and the optimizer with build_optimizer().
        - Read build_dataset() through a DistributedSampler(dataset,
          num_replicas=WORLD_SIZE, rank=RANK, shuffle=True, seed=SEED) in
          batches of BATCH_SIZE; set_epoch(epoch) before each epoch. (RANK is
          the rank among all workers; LOCAL_RANK only among those of one node:
          two nodes would read the same data.)
        - Train EPOCHS epochs: cross entropy, backward, optimizer step.
        - At the end of every epoch, global rank 0 alone saves the snapshot
          {"model": <the unwrapped model's state_dict>,
           "optimizer": optimizer.state_dict(),
           "epoch": <the epoch just finished>}
          to the path given as --snapshot, atomically: torch.save to a
          temporary file in the same folder, then os.replace onto the path.
          The path then always holds a complete snapshot, and a worker killed
          in the middle of a save leaves the previous one whole. (Never write
          the path itself: copying the finished file onto it, as
          shutil.copyfile does, writes it in place too. And not in the
          system's temporary folder, tempfile's default: on a cluster the
          snapshot lives on shared storage and /tmp on each node's own
          disk, and os.replace from one file system to another fails with
          EXDEV, "Invalid cross-device link".)
        - On start, if the snapshot exists, load it (map_location to this
          worker's device), restore the model and the optimizer, and start
          at the epoch after the saved one: after torchrun's restarts, and
          also when the whole job is launched again (a scheduler's requeue,
          where TORCHELASTIC_RESTART_COUNT is 0).
        - Leave the process group at the end.

How it is graded: the grader runs main() as the only worker, kills it as
the snapshot of epoch 2 reaches the path (half-way through writing the path
itself, or just before renaming a finished file onto it), then launches it
again from scratch on the same --snapshot, with TORCHELASTIC_RESTART_COUNT=0.
It runs your script under two real torchrun agents on this machine, standing
in for two nodes (--nnodes 2 --nproc-per-node 2, c10d rendezvous at a port
the grader holds, --max-restarts 1), kills one worker in the middle of an
epoch, and lets torchrun restart them all; and, at the same time, with
--nnodes 1 --nproc-per-node 4, uninterrupted. It then compares the final
weights with an uninterrupted run. Keep build_model, build_dataset,
build_optimizer and the constants as they are: the grader's uninterrupted
run uses the same.

Replace each `raise NotImplementedError` below; keep the names and signatures.
Grade it with:  ddp-grade exercises/15_elastic.py      (stuck? ddp-grade hint 15)
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = 4
BATCH_SIZE = 4
NUM_SAMPLES = 48
LR = 0.05
MOMENTUM = 0.9
SEED = 15


def build_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def build_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = torch.randint(0, 4, (NUM_SAMPLES,), generator=g)
    return TensorDataset(x, y)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fault-tolerant DDP training under torchrun.")
    parser.add_argument("--snapshot", default="snapshot.pt", help="where to save and resume the snapshot")
    return parser.parse_args()


def main() -> None:
    # TODO: read RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE; join the
    # process group; build the model (in DDP), the optimizer, and a
    # DistributedSampler over build_dataset(); resume from args.snapshot when it
    # exists; train EPOCHS epochs (set_epoch each); at the end of every epoch
    # rank 0 saves the snapshot atomically; leave the process group.
    raise NotImplementedError


if __name__ == "__main__":
    main()
