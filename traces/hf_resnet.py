"""A third-party CNN: Hugging Face transformers' ResNetForImageClassification in the ResNet-34
layout (basic blocks, depths 3-4-6-3) at 1/4 width, built from a config (random weights, no
download), trained with SGD (momentum) on synthetic 128x128 images. An ordinary training script;
capuchin runs it unmodified.

    python traces/hf_resnet.py --steps 6 --batch 8
"""

import argparse

import torch
from transformers import ResNetConfig, ResNetForImageClassification


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=[16, 32, 64, 128],
        depths=[3, 4, 6, 3],
        layer_type="basic",
        num_labels=10,
    )
    model = ResNetForImageClassification(config)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(args.steps):
        x = torch.randn(args.batch, 3, args.size, args.size)
        y = torch.randint(0, 10, (args.batch,))
        out = model(pixel_values=x, labels=y)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        print(f"step {step} loss {out.loss.item():.4f}")


if __name__ == "__main__":
    main()
