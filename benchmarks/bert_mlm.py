"""Hugging Face BERT masked LM trained with AdamW: 4 layers, hidden 256, batch 8, sequence 128,
the default vocabulary, dropout active; built from a config with random weights (no download).
Unmodified training script (the model and optimizer are module globals, so tests can read them).

    python benchmarks/bert_mlm.py --steps 5
"""

import argparse

import torch
from transformers import BertConfig, BertForMaskedLM

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--vocab", type=int, default=30522)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
config = BertConfig(
    vocab_size=args.vocab,
    hidden_size=args.hidden,
    num_hidden_layers=args.layers,
    num_attention_heads=max(1, args.hidden // 64),
    intermediate_size=4 * args.hidden,
    max_position_embeddings=max(512, args.seq),
)
model = BertForMaskedLM(config)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    labels = torch.where(torch.rand(ids.shape) < 0.15, ids, torch.full_like(ids, -100))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {out.loss.item():.4f}")
