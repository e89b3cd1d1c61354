"""A small CNN trained on synthetic images: 7 x (conv + batch norm + in-place ReLU), max-pool, linear,
SGD with momentum. An ordinary, unmodified training script (capuchin traces it as is).

    python traces/cnn.py --steps 6
"""

import argparse

import torch
from torch import nn


def block(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]


def make_model() -> nn.Module:
    # Deep enough that activations, not one layer's working set, make the peak (as in real CNNs).
    return nn.Sequential(
        *block(3, 16),
        *block(16, 16),
        *block(16, 16),
        *block(16, 16),
        nn.MaxPool2d(2),
        *block(16, 32),
        *block(32, 32),
        *block(32, 32),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
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
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(args.steps):
        x = torch.randn(args.batch, 3, 32, 32)
        y = torch.randint(0, 10, (args.batch,))
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
