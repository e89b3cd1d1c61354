"""A residual MLP language model whose blocks are compiled one by one (torchtitan's per-block
``torch.compile``): each block is a forward and a backward region, the embedding, the head and
the loss run eagerly between them. ``--dropout`` puts dropout inside every block's region,
``--norm batch`` batch norm (whose running statistics the region writes in place)."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--blocks", type=int, default=4)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--block", type=int, default=32)
parser.add_argument("--dropout", type=float, default=0.0)
parser.add_argument("--norm", choices=["layer", "batch"], default="layer")
args = parser.parse_args()


class Block(nn.Module):
    def __init__(self, dim, p):
        super().__init__()
        self.norm = nn.LayerNorm(dim) if args.norm == "layer" else nn.BatchNorm1d(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        h = self.norm(x) if args.norm == "layer" else self.norm(x.transpose(1, 2)).transpose(1, 2)
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(h))))


torch.manual_seed(0)
vocab = 128
embed = nn.Embedding(vocab, args.dim)
blocks = nn.ModuleList(Block(args.dim, args.dropout) for _ in range(args.blocks))
head = nn.Linear(args.dim, vocab)
model = nn.ModuleDict({"embed": embed, "blocks": blocks, "head": head})
for b in blocks:
    b.compile()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(args.steps):
    tokens = torch.randint(0, vocab, (args.batch, args.block + 1))
    x = embed(tokens[:, :-1])
    for b in blocks:
        x = b(x)
    logits = head(x)
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
