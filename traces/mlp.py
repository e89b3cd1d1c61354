"""A multi-layer perceptron on synthetic data: 8 hidden layers of 256, tanh, large batch, no dropout, RMSprop.
Unmodified training script.

    python traces/mlp.py --steps 6
"""

import argparse

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    args = parser.parse_args()
    if args.device == "cpu":
        train(args)
    else:  # every factory call (parameters, batches, masks) on the device
        with torch.device(args.device):
            train(args)


def train(args) -> None:
    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(128, 256),
        nn.Tanh(),
        *[m for _ in range(7) for m in (nn.Linear(256, 256), nn.Tanh())],
        nn.Linear(256, 10),
    )
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x = torch.randn(args.batch, 128)
        y = torch.randint(0, 10, (args.batch,))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
