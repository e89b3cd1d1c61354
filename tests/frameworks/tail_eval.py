"""A plain training loop that evaluates and saves after its last step (code after the last
optimizer step: not an iteration)."""

import argparse
import io

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

torch.manual_seed(0)
layers = [nn.Linear(64, 256), nn.ReLU()]
for _ in range(6):
    layers += [nn.Linear(256, 256), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for _ in range(args.steps):
    x = torch.randn(1024, 64)
    y = torch.randint(0, 10, (1024,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
# after the last step: an evaluation pass, a metric, a checkpoint
model.eval()
with torch.no_grad():
    x = torch.randn(512, 64)
    acc = (model(x).argmax(-1) == 0).float().mean().item()
torch.save(model.state_dict(), io.BytesIO())
print(f"accuracy {acc:.3f}")
