"""A model whose parameters and Adam state outweigh its activations (the probe's big_state.py of
../shared/reports/real-scripts.md, rebuilt small): an ``EmbeddingBag`` and an ``Embedding``
over a large vocabulary, a small MLP on top, Adam; the activations are a few KiB, the
parameters, their gradients and Adam's two moments several MiB."""

import argparse

import torch
from torch import nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--batch", type=int, default=16)
args = parser.parse_args()

torch.manual_seed(0)
vocab, dim, bag = 6000, 32, 8


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.emb = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim, 64), nn.ReLU(), nn.Linear(64, 2))

    def forward(self, bags, ids):
        return self.mlp(torch.cat([self.bag(bags), self.emb(ids)], dim=1))


model = Model()
opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
for step in range(args.steps):
    bags = torch.randint(0, vocab, (args.batch, bag))
    ids = torch.randint(0, vocab, (args.batch,))
    target = torch.randint(0, 2, (args.batch,))
    loss = F.cross_entropy(model(bags, ids), target)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    print("step", step, "loss", loss.item())
