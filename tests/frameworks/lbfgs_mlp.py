"""A closure-based optimizer: LBFGS calls the closure (forward and backward) several times per
step."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

torch.manual_seed(0)
layers = [nn.Linear(64, 256), nn.Tanh()]
for _ in range(4):
    layers += [nn.Linear(256, 256), nn.Tanh()]
model = nn.Sequential(*layers, nn.Linear(256, 10))
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4)
x = torch.randn(4096, 64)
y = torch.randint(0, 10, (4096,))


def closure():
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


for _ in range(args.steps):
    opt.step(closure)
