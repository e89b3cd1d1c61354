"""A Hugging Face GPT-2 trained on random tokens, for planner benchmarks (``capuchin trace``).

Built from a config (random weights, nothing downloaded); narrow so that it traces in seconds on
a CPU while keeping GPT-2's op structure per layer:

    capuchin trace --device cpu --iterations 2 -o gpt2-12.trace.parquet benchmarks/gpt2_train.py --layers 12
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=12)
ap.add_argument("--width", type=int, default=64)
ap.add_argument("--heads", type=int, default=2)
ap.add_argument("--seq", type=int, default=64)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--steps", type=int, default=6)
args = ap.parse_args()

torch.manual_seed(0)
cfg = GPT2Config(
    n_layer=args.layers,
    n_embd=args.width,
    n_head=args.heads,
    vocab_size=512,
    n_positions=args.seq,
    resid_pdrop=0.1,
    embd_pdrop=0.1,
    attn_pdrop=0.1,
)
model = GPT2LMHeadModel(cfg)
model.train()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
for _ in range(args.steps):
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
