"""A training loop that evaluates every --eval-every steps: the iteration after such a step also
runs the evaluation pass (a no_grad forward over a larger batch)."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--eval-every", type=int, default=2)
args = parser.parse_args()

torch.manual_seed(0)
layers = [nn.Linear(64, 256), nn.ReLU()]
for _ in range(6):
    layers += [nn.Linear(256, 256), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
val_x = torch.randn(2048, 64)
val_y = torch.randint(0, 10, (2048,))
for step in range(args.steps):
    x = torch.randn(1024, 64)
    y = torch.randint(0, 10, (1024,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % args.eval_every == args.eval_every - 1:
        model.eval()
        with torch.no_grad():
            val = nn.functional.cross_entropy(model(val_x), val_y).item()
        model.train()
        print(f"step {step} val {val:.4f}")
