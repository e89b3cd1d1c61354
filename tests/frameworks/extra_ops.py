"""A training loop that, every ``--every`` steps, runs ops its traced iteration did not: a data
loader's epoch-start ``randperm`` (``--where start``) or a logging op between forward and
backward (``--where middle``). ``--big``: the extra op allocates far more than a plan's headroom.
``--short-from N``: from step N on, the epoch's permutation is shorter (other shapes at the op that
slices it: a real divergence). ``--transient``: the epoch's permutation is read into a list and
freed at once, as a ``DataLoader``'s sampler does."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--where", choices=["start", "middle"], default="start")
parser.add_argument("--big", action="store_true")
parser.add_argument("--short-from", type=int, default=-1)
parser.add_argument("--transient", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
layers = [nn.Linear(64, 256), nn.ReLU()]
for _ in range(6):
    layers += [nn.Linear(256, 256), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(256, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.randn(4096, 64)
labels = torch.randint(0, 10, (4096,))
perm = torch.arange(4096)
logged = []


def extra(step):
    # the traced iteration (step 1) runs none of this
    if args.big:
        return torch.randn(4_000_000)
    return torch.randperm(3072 if 0 <= args.short_from <= step else 4096)


for step in range(args.steps):
    if args.where == "start" and step % args.every == args.every - 1:
        if args.transient:  # as a DataLoader's sampler: the permutation read into a list
            order = extra(step).tolist()
        else:
            new = extra(step)
            if not args.big:
                perm = new  # a new epoch: the sampler's permutation
    idx = perm[(step % 6) * 512 : (step % 6 + 1) * 512]
    x, y = data[idx], labels[idx]
    loss = nn.functional.cross_entropy(model(x), y)
    if args.where == "middle" and step % args.every == args.every - 1:
        logged.append(extra(step))  # a logging op kept by the script
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"loss {loss.item():.4f}")
