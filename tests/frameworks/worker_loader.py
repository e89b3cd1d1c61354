"""A training loop fed by a ``DataLoader`` with two worker processes (the default setup of most
real scripts): each batch is collated in a worker and rebuilt in the main process from shared
memory (``aten.empty.memory_format`` + ``aten.set_``) whenever the main process receives it,
which depends on the workers' timing. Shuffled, so each epoch starts with a ``randperm``."""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--workers", type=int, default=2)
args = parser.parse_args()

torch.manual_seed(0)
data = TensorDataset(torch.randn(512, 64), torch.randint(0, 10, (512,)))
loader = DataLoader(
    data,
    batch_size=64,
    shuffle=True,
    num_workers=args.workers,
    generator=torch.Generator().manual_seed(0),
)
model = nn.Sequential(
    nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
step = 0
while step < args.steps:
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("step", step, "loss", float(loss))
        step += 1
        if step == args.steps:
            break
