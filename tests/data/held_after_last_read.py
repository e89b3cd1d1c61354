"""An MLP whose loop holds a large temporary (its input, widened) after its last read, until the
step ends: the dead storage of planner/dead.py Note [Dead storages]."""

import argparse

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--optim", default="adamw-foreach")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(
        *[m for _ in range(6) for m in (nn.Linear(256, 256), nn.Tanh())], nn.Linear(256, 10)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=args.optim == "adamw-foreach")
    for _ in range(args.steps):
        x = torch.randn(1024, 256)
        wide = x.repeat(1, 2)  # 2 MiB, last read by the mean below, held until the step ends
        h = wide.view(1024, 2, 256).mean(1)
        loss = model(h).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        del wide


if __name__ == "__main__":
    main()
