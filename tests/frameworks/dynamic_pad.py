"""Dynamic padding: each batch of 8 token sequences of random lengths is padded to its longest
(``pad_sequence``), so the collate ops' shapes change every step; the longest is 24 at odd steps
and 20 at even ones (two buckets; ``--buckets 3``: 20, 24, 28 in turn). A plan made from a
24-step applies to every 24-step."""

import argparse

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--buckets", type=int, choices=[2, 3], default=2)
args = parser.parse_args()

torch.manual_seed(0)
vocab = 500
model = nn.Sequential(
    nn.Embedding(vocab, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU()
)
head = nn.Linear(256, 4)
params = [*model.parameters(), *head.parameters()]
opt = torch.optim.Adam(params, lr=1e-3)
gen = torch.Generator().manual_seed(1)
for step in range(args.steps):
    longest = (24 if step % 2 else 20) if args.buckets == 2 else (20, 24, 28)[step % 3]
    lengths = torch.randint(longest // 2, longest, (8,), generator=gen).tolist()
    lengths[0] = longest
    seqs = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]
    x = pad_sequence(seqs, batch_first=True)  # (8, longest), 0 = padding
    y = torch.randint(0, 4, (8,), generator=gen)
    mask = (x != 0).unsqueeze(-1).float()
    h = (model(x) * mask).sum(1) / mask.sum(1)
    loss = nn.functional.cross_entropy(head(h), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("step", step, "loss", float(loss))
