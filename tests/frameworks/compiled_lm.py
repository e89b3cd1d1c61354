"""A compiled transformer language model (torch.compile of the whole model)."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

torch.manual_seed(0)
vocab, dim = 256, 64
layer = nn.TransformerEncoderLayer(dim, 4, dim_feedforward=128, dropout=0.0, batch_first=True)
model = nn.Sequential(
    nn.Embedding(vocab, dim), nn.TransformerEncoder(layer, 2), nn.Linear(dim, vocab)
)
compiled = torch.compile(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(args.steps):
    tokens = torch.randint(0, vocab, (32, 65))
    logits = compiled(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
