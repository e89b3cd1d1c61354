"""A tiny Hugging Face GPT-2 (built from a config: random weights, nothing downloaded) trained
compiled: ``torch.compile(model)``, dropout active by default (random numbers drawn inside the
compiled regions), AdamW, random tokens."""

import argparse
import gc
import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--dropout", type=float, default=0.1)
args = parser.parse_args()

torch.manual_seed(0)
cfg = GPT2Config(
    n_layer=args.layers,
    n_head=2,
    n_embd=64,
    vocab_size=256,
    n_positions=32,
    resid_pdrop=args.dropout,
    embd_pdrop=args.dropout,
    attn_pdrop=args.dropout,
)
model = GPT2LMHeadModel(cfg)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
compiled = torch.compile(model)
data = torch.randint(0, cfg.vocab_size, (32, 32))
for _ in range(args.steps):
    tokens = data[torch.randint(0, data.shape[0], (4,))]
    loss = compiled(input_ids=tokens, labels=tokens).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    # Each compiled step leaves reference cycles (about 180 objects) that hold a logits-sized
    # storage until Python's cyclic collector runs; when it runs depends on the Python objects
    # allocated, which the tracer and the runtime change, so a storage the trace saw freed can be
    # alive in the run (docs/works-with.md). Collected here, both see the same lifetimes.
    gc.collect()
