"""Exercise 29: a sharded checkpoint that resumes on 2 ranks and not on 3.

Bug report
----------
> Our FSDP2 job saves a checkpoint after every epoch and resumes from one with
> --resume. Each rank saves its own shards, so nothing is gathered onto one rank,
> and restarting on the same number of nodes works. Last night the scheduler gave the
> resumed job 3 nodes instead of 2, and it died at once: rank 2 found no file to
> read, and ranks 0 and 1 raised a size mismatch while loading. We cannot always get
> the same number of nodes back.

What to do
----------
Find why the checkpoint only loads on as many ranks as saved it and fix the script.
Afterwards a job resumed on any number of ranks goes on exactly where the checkpoint
left off (the weights, the optimizer's momentum and the epoch count), each rank
still writing its own part of the checkpoint. Keep the model, the data order, the
batch size, the optimizer and the learning rate.

Run it yourself (without --data it makes up a small data set):
    torchrun --nproc-per-node=2 exercises/debug/29_reshard_resume.py --epochs 1
    torchrun --nproc-per-node=3 exercises/debug/29_reshard_resume.py --epochs 2 --resume runs/reshard_resume/checkpoint
Grade it:  ddp-grade exercises/debug/29_reshard_resume.py      (stuck? ddp-grade hint 29)

The grader runs main(argv) as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set) with --data, --out and --epochs: first on 2 processes for 1 epoch,
then on 2 and on 3 processes with --resume pointing at the first run's
--out/checkpoint, for 2 epochs in all. It reads which files each rank wrote, and
compares the model rank 0 saves at the end with a replay, in one process, of the
training that never stopped.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

VOCAB, DIM, HIDDEN, LAYERS, SEQ = 256, 32, 64, 2, 8
BATCH_SIZE = 4  # per rank
LR, MOMENTUM = 0.05, 0.9


class Block(nn.Module):
    """A residual MLP block: norm, up projection, GELU, down projection, added to its input."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """Token embeddings, the blocks, a final norm and the output head."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        """Logits of every position: [batch * seq, VOCAB]."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h).flatten(0, 1))


def load_data(path):
    """Token sequences and their next tokens, from torch.save({"train_x", "train_y"})."""
    if path is None:  # a small made-up problem, enough to reproduce the report
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (48, SEQ + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    data = torch.load(path)
    return TensorDataset(data["train_x"], data["train_y"])


def save_checkpoint(path, model, optimizer, epoch):
    """Each rank saves its own shards: its part of every parameter and of its momentum buffer."""
    rank = dist.get_rank()
    os.makedirs(path, exist_ok=True)
    shards = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    momentum = {name: optimizer.state[p]["momentum_buffer"].to_local().clone()
                for name, p in model.named_parameters()}
    torch.save({"model": shards, "momentum": momentum, "epoch": epoch},
               os.path.join(path, f"rank{rank}.pt"))
    dist.barrier()  # the checkpoint is complete once every rank has written its file


def load_checkpoint(path, model, optimizer):
    """Each rank reads back its own shards; returns the epoch the checkpoint was saved after."""
    rank = dist.get_rank()
    saved = torch.load(os.path.join(path, f"rank{rank}.pt"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(saved["model"][name])
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
            optimizer.state[p]["momentum_buffer"].to_local().copy_(saved["momentum"][name])
    return saved["epoch"]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default="runs/reshard_resume")
    parser.add_argument("--resume", default=None, help="a checkpoint folder to go on from")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")  # torchrun set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)

    train_set = load_data(args.data)
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=BATCH_SIZE, sampler=sampler)

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    start_epoch = 0
    if args.resume is not None:
        start_epoch = load_checkpoint(args.resume, model, optimizer) + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
        save_checkpoint(os.path.join(args.out, "checkpoint"), model, optimizer, epoch)

    # every rank takes part in gathering the full state dict; rank 0 writes it
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(state, os.path.join(args.out, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
