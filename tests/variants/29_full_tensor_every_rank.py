"""Exercise 29, fixed the wrong way: every rank gathers the whole model and its momentum with full_tensor() and
torch.saves them into a file of its own, rank{r}.pt. A job on any number of ranks reads one of them back and keeps
its shard, so it resumes; but each file holds the whole checkpoint, and each rank held the whole model to write it."""
# expect-fail: own-shards whole-model
# expect-pass: own-files resumes-same-size resumes-other-size

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
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
    """Each rank writes the whole model and momentum, gathered with full_tensor(), into a file of its own:
    any number of ranks can read it back."""
    os.makedirs(path, exist_ok=True)
    model_state = {name: p.full_tensor() for name, p in model.named_parameters()}
    momentum = {name: optimizer.state[p]["momentum_buffer"].full_tensor() for name, p in model.named_parameters()}
    torch.save({"model": model_state, "momentum": momentum, "epoch": epoch},
               os.path.join(path, f"rank{dist.get_rank()}.pt"))


def load_checkpoint(path, model, optimizer):
    """Read this rank's file if there is one (else rank 0's: they hold the same) and keep this rank's shard of
    each tensor; returns the epoch the checkpoint was saved after."""
    mine = os.path.join(path, f"rank{dist.get_rank()}.pt")
    state = torch.load(mine if os.path.exists(mine) else os.path.join(path, "rank0.pt"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            shard = distribute_tensor(state["model"][name], p.device_mesh, p.placements)
            p.copy_(shard)
            optimizer.state[p]["momentum_buffer"] = distribute_tensor(state["momentum"][name], p.device_mesh,
                                                                       p.placements)
    return state["epoch"]


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
