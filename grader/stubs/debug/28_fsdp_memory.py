"""Exercise 28: after moving to FSDP2, each rank's memory barely drops.

Bug report
----------
> We moved this job from DDP to FSDP2 to fit a bigger model: fully_shard on a
> DeviceMesh of all the ranks, as the docs show. With DDP every rank held the whole
> model and its momentum buffers; with FSDP2 we expected each rank to hold about
> 1/world_size of them. On 2 ranks the parameters and optimizer state a rank holds
> went down by only a third, and adding ranks hardly changes it. Training runs, the
> loss goes down, and nothing raises.

What to do
----------
Find why each rank still holds most of the model and fix the script. Afterwards each
rank holds about 1/world_size of the parameters and of the optimizer's state, each
block is still sharded on its own, and training is otherwise unchanged: keep the
model, the data order, the batch size, the optimizer and the learning rate.

Run it yourself (without --data it makes up a small data set):
    torchrun --nproc-per-node=2 exercises/debug/28_fsdp_memory.py
Grade it:  ddp-grade exercises/debug/28_fsdp_memory.py      (stuck? ddp-grade hint 28)

The grader runs main(argv) in 2 and in 3 processes as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) with --data, --out and --epochs,
measures at every optimizer step what each rank holds of the parameters and the
optimizer's state, counts FSDP's parameter all-gathers, and compares the model rank 0
saves with a replay of the training in one process.
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


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=None)
    parser.add_argument("--out", default="runs/fsdp_memory")
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
    # shard every transformer block on its own, as the FSDP2 docs show
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")

    # every rank takes part in gathering the full state dict; rank 0 writes it
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(state, os.path.join(args.out, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
