"""A training loop whose batch is 256 rows except at the steps ``--other`` lists, where it is 160
(a last partial batch, a bucket of dynamic padding): those iterations diverge from a plan made
for 256, and the plan applies again at the next batch of 256. ``--keep N``: from step N on the
script keeps 2 MiB the plan never saw (a buffer made at that step)."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--other", type=int, nargs="*", default=[])
parser.add_argument("--keep", type=int, default=-1)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.randn(256, 64)
labels = torch.randint(0, 10, (256,))
kept = None
for step in range(args.steps):
    if step == args.keep:
        kept = torch.zeros(1 << 19)
    n = 160 if step in args.other else 256
    loss = nn.functional.cross_entropy(model(data[:n]), labels[:n])
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("step", step, "loss", float(loss))
