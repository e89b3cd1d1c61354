"""A multi-layer perceptron on synthetic data: 8 hidden layers of 256, tanh, large batch, no dropout, RMSprop.
Unmodified training script (RMSprop by default; --optim picks AdamW in its loop, foreach or fused form).

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
    parser.add_argument(
        "--optim",
        choices=["rmsprop", "adamw", "adamw-foreach", "adamw-fused"],
        default="rmsprop",
        help="adamw: the per-tensor loop (foreach=False); -foreach / -fused: the multi-tensor forms",
    )
    parser.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ to this norm")
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
    if args.optim == "rmsprop":
        opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    else:
        form = {"adamw": {"foreach": False}, "adamw-foreach": {"foreach": True}}
        opt = torch.optim.AdamW(
            model.parameters(), lr=1e-3, **form.get(args.optim, {"fused": True})
        )
    for step in range(args.steps):
        x = torch.randn(args.batch, 128)
        y = torch.randint(0, 10, (args.batch,))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if args.clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip, foreach=args.optim != "adamw")
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
